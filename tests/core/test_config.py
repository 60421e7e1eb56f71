"""Settings: defaults, yaml + LLAVA_* environment sources, validation messages, docs table."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from llava_sessions import config
from llava_sessions.config import ENV_PREFIX, Settings

GIB = 1024**3
MIB = 1024**2


def test_public_api_is_pinned() -> None:
    assert sorted(config.__all__) == [
        "ENV_PREFIX",
        "SPARE_JOB_GROUPS",
        "Settings",
        "job_groups",
        "resolve_devices",
        "with_hints",
    ]


def test_defaults_match_the_documented_values() -> None:
    s = Settings()
    assert s == Settings.from_sources(None, None) == Settings.from_sources({}, {})
    assert (s.model_dir, s.device, s.gpu_id, s.dtype) == ("", "auto", None, "auto")
    assert (s.session_ttl_s, s.idle_timeout_s) == (1200, 0)
    assert (s.device_budget_bytes, s.device_budget_fraction, s.host_budget_bytes) == (0, 0.8, 2 * GIB)
    assert s.max_sessions == 128
    assert (s.max_new_tokens_cap, s.default_max_new_tokens) == (1024, 256)
    assert (s.max_prompt_chars, s.max_prompt_tokens) == (16000, 2048)
    assert s.max_body_bytes == 6_291_456
    assert (s.max_image_bytes, s.max_image_pixels) == (20 * MIB, 40_000_000)
    assert (s.allow_http, s.allow_private_networks, s.url_allowlist) == (False, False, ())
    assert (s.fetch_connect_timeout_s, s.fetch_read_timeout_s, s.max_redirects) == (5.0, 20.0, 3)
    assert s.max_concurrent_generations == 0  # 16 on a CPU, 64 on a GPU (wire/in_flight.py)
    assert (s.step_max_tokens, s.step_max_ms) == (1, 100.0)
    assert (s.system_prompt, s.log_level) == (None, "WARNING")


def test_settings_are_frozen_and_refuse_unknown_fields() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.session_ttl_s = 5  # type: ignore[misc]
    with pytest.raises(ValidationError, match="extra"):
        Settings(sesion_ttl_s=5)  # type: ignore[call-arg]
    assert hash(s) == hash(Settings())


def test_yaml_section_values_are_used() -> None:
    section = {
        "model_dir": "/opt/ml/model/llava",
        "device": "CUDA",
        "gpu_id": 1,
        "dtype": "bfloat16",
        "session_ttl_s": "600",  # yaml may quote numbers
        "url_allowlist": ["img.example.com", ".Example.ORG."],
        "allow_http": True,
        "log_level": "info",
    }
    s = Settings.from_sources(section)
    assert s.model_dir == "/opt/ml/model/llava"
    assert (s.device, s.gpu_id, s.dtype) == ("cuda", 1, "bfloat16")
    assert s.session_ttl_s == 600
    assert s.url_allowlist == ("img.example.com", ".example.org")
    assert s.allow_http is True
    assert s.log_level == "INFO"


def test_a_bare_on_or_off_in_yaml_is_the_compile_setting_not_a_boolean() -> None:
    from llava_tools.cli import parse_assignment

    for text, value in (("compile=on", "on"), ("compile=off", "off"), ("compile=ON", "on")):
        assert Settings.from_sources(dict([parse_assignment(text)])).compile == value
    assert Settings.from_sources(yaml.safe_load("compile: on\n")).compile == "on"  # model-config.yaml, PyYAML


@pytest.mark.parametrize(
    ("section", "env"),
    [({"kv_pool": "on"}, {}), ({"decode_layout": "contiguous"}, {}), ({}, {"LLAVA_KV_POOL": "off"})],
)
def test_a_setting_that_is_gone_is_refused_in_one_line_saying_so(section: dict, env: dict) -> None:
    """``kv_pool`` and ``decode_layout`` chose a layout that no longer exists: a config or an
    environment that still names one is refused, in one line that says the setting is gone and what
    to do, not with the whole list of settings."""
    with pytest.raises(ValueError) as info:
        Settings.from_sources(section, env)
    message = str(info.value)
    assert "\n" not in message and "setting is gone" in message and message.endswith("delete it")
    assert "valid keys" not in message and "did you mean" not in message


def test_environment_overrides_yaml_and_is_parsed_by_field_type() -> None:
    env = {
        "LLAVA_SESSION_TTL_S": "600",
        "LLAVA_DEVICE_BUDGET_FRACTION": "0.5",
        "LLAVA_HOST_BUDGET_BYTES": "1_073_741_824",
        "LLAVA_ALLOW_HTTP": "yes",
        "LLAVA_ALLOW_PRIVATE_NETWORKS": "0",
        "LLAVA_URL_ALLOWLIST": "a.example.com, .b.example.com,,",
        "LLAVA_GPU_ID": "",
        "LLAVA_SYSTEM_PROMPT": "  Answer briefly.  ",
        "LLAVA_STEP_MAX_MS": "50",
        "LLAVA_MODEL_DIR": " /models/llava ",
        "LLAVA_TS_LOG_CONFIG": "/x.xml",  # a tool's variable, not a setting: left alone
        "SESSION_TTL_S": "1",  # no prefix: ignored
    }
    s = Settings.from_sources({"session_ttl_s": 900, "gpu_id": 2, "allow_private_networks": True}, env)
    assert s.session_ttl_s == 600
    assert s.device_budget_fraction == 0.5
    assert s.host_budget_bytes == GIB
    assert s.allow_http is True and s.allow_private_networks is False
    assert s.url_allowlist == ("a.example.com", ".b.example.com")
    assert s.gpu_id is None  # empty clears an optional field
    assert s.system_prompt == "  Answer briefly.  "  # free text kept as written
    assert s.step_max_ms == 50.0
    assert s.model_dir == "/models/llava"


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "yes", "on"])
def test_environment_true_spellings(text: str) -> None:
    assert Settings.from_sources(None, {"LLAVA_ALLOW_HTTP": text}).allow_http is True


@pytest.mark.parametrize("text", ["0", "false", "No", "off"])
def test_environment_false_spellings(text: str) -> None:
    assert Settings.from_sources({"allow_http": True}, {"LLAVA_ALLOW_HTTP": text}).allow_http is False


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [
        ("LLAVA_SESSION_TTL_S", "ten", "LLAVA_SESSION_TTL_S='ten': session_ttl_s must be an integer"),
        ("LLAVA_STEP_MAX_MS", "fast", "step_max_ms must be a number"),
        ("LLAVA_ALLOW_HTTP", "maybe", "allow_http must be a boolean"),
        ("LLAVA_SESSION_TTL_S", "-5", "session_ttl_s (from LLAVA_SESSION_TTL_S): Input should be greater than 0"),
    ],
)
def test_bad_environment_values_name_the_variable(var: str, value: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_sources(None, {var: value})
    assert expected in str(info.value)


def test_unknown_yaml_key_names_it_and_lists_valid_keys() -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_sources({"sessionExpiryInMinutes": 20, "session_ttl_s": 60})
    message = str(info.value)
    assert "sessionExpiryInMinutes" in message
    assert "valid keys:" in message
    for name in Settings.model_fields:
        assert name in message


def test_a_misspelt_key_gets_its_closest_setting_not_the_whole_list() -> None:
    """The fix in one short line: the closest setting and where every setting is listed, not all 64."""
    with pytest.raises(ValueError) as info:
        Settings.check_names({"session_tl_s": 5}, "in --set")
    message = str(info.value)
    assert message == (
        "unknown key(s) in --set: session_tl_s (did you mean session_ttl_s?); every setting: docs/configuration.md"
    )


def test_yaml_section_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        Settings.from_sources(["session_ttl_s"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ({"session_ttl_s": 0}, "session_ttl_s (from handler.session_ttl_s): Input should be greater than 0 (got 0)"),
        ({"idle_timeout_s": -1}, "idle_timeout_s"),
        ({"device_budget_fraction": 0}, "device_budget_fraction"),
        ({"device_budget_fraction": 1.5}, "less than or equal to 1"),
        ({"device_budget_fraction": float("nan")}, "finite"),
        ({"host_budget_bytes": 0}, "host_budget_bytes"),
        ({"max_sessions": 0}, "max_sessions"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"gpu_id": -1}, "gpu_id"),
        ({"fetch_read_timeout_s": 0}, "fetch_read_timeout_s"),
        ({"max_redirects": -1}, "max_redirects"),
        ({"step_max_tokens": 0}, "step_max_tokens"),
        ({"log_level": "LOUD"}, "log_level"),
        ({"url_allowlist": ["https://img.example.com/"]}, "no scheme, port or path"),
        ({"url_allowlist": "img.example.com:443"}, "no scheme, port or path"),
        ({"default_max_new_tokens": 2000}, "default_max_new_tokens (2000) must be <= max_new_tokens_cap (1024)"),
        ({"device": "cpu", "gpu_id": 0}, "gpu_id is set but device is 'cpu'"),
    ],
)
def test_range_errors_say_what_to_fix(section: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_sources(section)
    assert fragment in str(info.value)


def test_several_errors_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_sources({"session_ttl_s": 0, "max_sessions": 0})
    assert "session_ttl_s" in str(info.value) and "max_sessions" in str(info.value)


def test_system_prompt_is_never_echoed_in_errors() -> None:
    with pytest.raises(ValueError) as info:
        Settings.from_sources({"system_prompt": 12345, "session_ttl_s": 0})
    assert "12345" not in str(info.value)


def test_env_table_lists_every_field() -> None:
    table = Settings.env_table()
    lines = table.strip().splitlines()
    assert lines[0] == "| env var | field | default | description |"
    assert len(lines) == 2 + len(Settings.model_fields)
    for name, info in Settings.model_fields.items():
        row = next(line for line in lines if f"| `{name}` |" in line)
        assert row.startswith(f"| `{ENV_PREFIX}{name.upper()}` |")
        assert info.description and info.description.split(";")[0].split("(")[0].strip() in row
    assert "| `LLAVA_MAX_BODY_BYTES` | `max_body_bytes` | `6291456 (6 MiB)` |" in table
    assert "| `LLAVA_HOST_BUDGET_BYTES` | `host_budget_bytes` | `2147483648 (2 GiB)` |" in table
    assert "| `LLAVA_GPU_ID` | `gpu_id` | `(unset)` |" in table


def test_every_llava_variable_the_tools_read_is_a_setting_or_listed_as_theirs() -> None:
    """An LLAVA_* name read anywhere outside the tests is a setting's variable or in TOOL_ENV_VARS,
    so the settings check never refuses a variable the project itself sets."""
    import re
    from pathlib import Path

    from llava_sessions.config import ENV_PREFIX, TOOL_ENV_VARS

    root = Path(__file__).resolve().parents[2]
    files = [*root.glob("handler/**/*.py"), *root.glob("client/**/*.py"), *root.glob("benchmarks/*.py")]
    files += [root / "build_and_push.sh", root / "Dockerfile", root / "Makefile", *root.glob("notebooks/*.ipynb")]
    files += [*root.glob("docker/*")]
    names = {m for f in files if f.is_file() for m in re.findall(r"\bLLAVA_[A-Z0-9_]*[A-Z0-9]\b", f.read_text())}
    settings = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    constants = {"LLAVA_NEXT_CHAT_TEMPLATE"}  # a Python constant of the tiny-model builder, not a variable
    assert names - settings - constants - TOOL_ENV_VARS == set()


# ---- one source: the Settings fields, model-config.yaml's handler section and the docs' short table ----

_MODEL_CONFIG = Path(__file__).resolve().parents[2] / "model-config.yaml"
_CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def shipped_handler_section(keys: list[str]) -> str:
    """model-config.yaml's ``handler:`` section as it must read for ``keys``: each key's value is its
    ``Settings`` default and its comment is its ``Settings`` description, wrapped at 100 columns."""
    import textwrap

    lines = ["handler:"]
    for key in keys:
        info = Settings.model_fields[key]
        lines += textwrap.wrap(
            info.description or "", 100, initial_indent="  # ", subsequent_indent="  # ", break_on_hyphens=False
        )
        default = info.default
        if isinstance(default, tuple):
            value = ",".join(default)
        elif isinstance(default, bool):
            value = str(default).lower()
        elif isinstance(default, float) and default.is_integer():
            value = str(int(default))
        elif default == "":
            value = '""'
        else:
            value = str(default)
        lines.append(f"  {key}: {value}")
    return "\n".join(lines) + "\n"


def short_default(key: str) -> str:
    """A setting's default as the short table of docs/configuration.md writes it (``2 GiB``, ``auto``, ``true``, ``150``)."""
    default = Settings.model_fields[key].default
    if isinstance(default, bool):
        return str(default).lower()
    if isinstance(default, int) and default >= 1 << 30 and default % (1 << 30) == 0:
        return f"{default >> 30} GiB"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def test_model_config_yaml_ships_the_settings_defaults_with_their_descriptions():
    """Issue 45 item 4: the handler section of model-config.yaml is the Settings' defaults with their
    descriptions as comments (it said 8 GiB of host memory for the image-feature tier, where the
    setting is 2 GiB of image bytes and conversations), so the three cannot drift apart."""
    import yaml

    text = _MODEL_CONFIG.read_text()
    section = text[text.index("\nhandler:\n") + 1 :]
    keys = list(yaml.safe_load(text)["handler"])
    assert section == shipped_handler_section(keys), "model-config.yaml's handler section, as it must read:\n" + (
        shipped_handler_section(keys)
    )


def test_the_short_settings_table_shows_the_settings_defaults():
    """Every row of docs/configuration.md's table of the settings most deployments touch names
    settings and their defaults (``a`` / ``b`` rows: each in turn), equal to ``Settings``'."""
    table = _CONFIGURATION.read_text().split("## The settings most deployments touch", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 10
    for keys, defaults in rows:
        names = re.findall(r"`(\w+)`", keys)
        shown = [d.strip().strip("`") for d in defaults.split(" / ")]
        assert len(names) == len(shown), keys
        for name, value in zip(names, shown, strict=True):
            assert value.split(" (")[0] == short_default(name), (name, value, short_default(name))
