"""Docs that are generated from code stay in sync with it."""

from pathlib import Path

import pytest

from llava_sessions.config import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_table_matches_settings():
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert Settings.env_table().strip() in text


@pytest.mark.integration
def test_readme_client_example_runs_as_written_on_the_default_tiny_model(tmp_path, photos, monkeypatch, request):
    """The README's Python example, unchanged but for where the client connects, against the model
    ``make demo`` builds (several images need its 4,096 positions): it used to end in a 422."""
    import re

    from llava_tools.tiny_model import write_checkpoint
    from server_fixtures import start_local_server

    text = (ROOT / "README.md").read_text()
    api = text[text.index("## API") :]
    block = re.search(r"```python\n(.*?)```", api, re.S).group(1)
    assert 'SessionClient.from_endpoint("my-llava-endpoint")' in block and 'add_image("second.jpg")' in block
    model_dir = write_checkpoint("tiny", tmp_path / "tiny", seed=0)
    server = start_local_server(model_dir, addfinalizer=request.addfinalizer)
    block = block.replace('SessionClient.from_endpoint("my-llava-endpoint")', f"SessionClient.from_url({server.url!r})")
    (tmp_path / "photo.jpg").write_bytes(photos["chelsea"])
    (tmp_path / "second.jpg").write_bytes(photos["rocket"])
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - the README's own code
