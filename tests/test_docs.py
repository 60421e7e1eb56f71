"""Docs that are generated from code stay in sync with it."""

from pathlib import Path

from llava_sessions.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_table_matches_settings():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert Settings.env_table().strip() in text
