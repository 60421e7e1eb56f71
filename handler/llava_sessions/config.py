"""One frozen, validated settings object for the handler.

Settings come from two sources, later ones winning:

1. the ``handler:`` section of TorchServe's ``model-config.yaml`` (keys are the field names), and
2. environment variables ``LLAVA_<FIELD NAME UPPER-CASED>`` (for example ``LLAVA_SESSION_TTL_S=600``).

Everything is validated up front; an error message names the offending key (or variable) and says what to
change. No torch here: ``device`` and ``dtype`` stay strings ("auto" is resolved once a GPU is known).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = ["ENV_PREFIX", "SPARE_JOB_GROUPS", "Settings", "job_groups", "resolve_devices", "with_hints"]

#: Prefix of the environment variables that override a field (``LLAVA_`` + field name upper-cased).
ENV_PREFIX = "LLAVA_"

#: ``LLAVA_*`` variables that are not handler settings: read by the tools (llava-serve, the container
#: entrypoint, llava-deploy, build_and_push.sh, the benchmarks, the GPU suite) and the notebook. Any
#: other ``LLAVA_*`` variable must name a setting (a typo is refused, with the closest name).
# fmt: off
TOOL_ENV_VARS = frozenset({
    "LLAVA_HOME", "LLAVA_CONTAINER_MODEL_DIR", "LLAVA_CONTAINER_PORT", "LLAVA_CONTAINER_HOST", "LLAVA_TS_LOG_CONFIG",
    "LLAVA_NOTEBOOK_SAGEMAKER", "LLAVA_DEPLOY", "LLAVA_S3_PREFIX", "LLAVA_KEEP_ENDPOINT", "LLAVA_IMAGE_URI",
    "LLAVA_SAGEMAKER_ROLE_ARN", "LLAVA_INSTANCE_TYPE", "LLAVA_ENDPOINT_NAME", "LLAVA_ECR_REPOSITORY",
    "LLAVA_FLOOR_BODY_FILE", "LLAVA_FLOOR_MODEL_DIR", "LLAVA_IMAGE_RELAY", "LLAVA_API_KEY", "LLAVA_TEST_DEVICE",
})
# fmt: on

_GIB, _MIB = 1024**3, 1024**2

#: Settings that no longer exist, and why: a config naming one is refused in one line, not run as if it were.
REMOVED_SETTINGS = {"kv_pool": "every session's KV is in the KV pool", "decode_layout": "answers decode in their pages"}

#: TorchServe job groups kept above the sessions a worker may hold (docs/decisions/43-spare-job-groups.md):
#: a new session past ``max_sessions`` still reaches the handler, which answers ``503 overloaded``
#: with Retry-After instead of the frontend's own 503.
SPARE_JOB_GROUPS = 8


def job_groups(max_sessions: int, replicas: int = 1) -> int:
    """TorchServe's ``batchSize`` and ``maxNumSequence`` for a worker of ``replicas`` replicas that
    hold ``max_sessions`` sessions each: ``max_sessions x replicas + SPARE_JOB_GROUPS``. A worker
    watches its job groups with ``batchSize + 1`` threads and serialises sessions past that
    (docs/platform.md)."""
    return max_sessions * replicas + SPARE_JOB_GROUPS


#: SageMaker's InvokeEndpoint body limit, 6 MiB (botocore sagemaker-runtime service model).
_SAGEMAKER_MAX_BODY_BYTES = 6_291_456

_HOST_RE = re.compile(r"^\.?[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:[0-9]+)?)$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


class Settings(BaseModel):
    """Validated handler settings; immutable once built.

    Build it with :meth:`from_sources` (yaml ``handler:`` section + ``LLAVA_*`` environment)
    or directly with keyword arguments (tests). Units are in the field names: ``_bytes``,
    ``_s`` (seconds), ``_ms`` (milliseconds).

    Raises:
        pydantic.ValidationError (a ``ValueError``): on construction with an invalid value.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    # --- model and device -------------------------------------------------------------------
    model_dir: str = Field("", description="Local llava-hf checkpoint folder (shipped empty: the tools write it).")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description='"auto" (cuda when available, else cpu), "cpu" or "cuda".'
    )
    gpu_id: int | None = Field(None, ge=0, description="CUDA device index; empty: the gpu_id TorchServe gives.")
    devices: str = Field(
        "auto",
        description='Model replicas of this worker: "auto" (one per tensor_parallel_size visible GPUs when device is '
        'not cpu and gpu_id is unset, else one on device/gpu_id) or a list such as "cuda:0,cuda:1" or "cpu,cpu". '
        "Each replica is a process with its own model, KV budget, max_sessions and 1/N of the host budget.",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs (CPU: processes) a replica's model is sharded over.")
    torch_threads: int = Field(
        0, ge=0, description="torch intra-op threads per replica; 0 = torch's default (split over CPU replicas)."
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description='"auto" (bfloat16 on a GPU from compute capability 8.0, else float16; float32 on CPU).'
    )

    # --- sessions and memory ----------------------------------------------------------------
    session_ttl_s: int = Field(
        1200, gt=0, description="Absolute lifetime of a session from open, in seconds (the SageMaker Expires instant)."
    )
    idle_timeout_s: int = Field(0, ge=0, description="A session idle this many seconds expires; 0: no idle timeout.")
    device_budget_bytes: int = Field(0, ge=0, description="Device bytes for session caches; 0: device_budget_fraction.")
    device_budget_fraction: float = Field(0.8, gt=0.0, le=1.0, description="Share of free device memory for sessions.")
    host_budget_bytes: int = Field(2 * _GIB, gt=0, description="Host bytes sessions hold (media bytes + conversation).")
    kv_offload_bytes: int = Field(4 * _GIB, ge=0, description="Host bytes a GPU moves demoted KV pages to (0: none).")
    cpu_memory_reserve_bytes: int = Field(
        2 * _GIB,
        ge=0,
        description="On a CPU device, heap bytes a replica writes once at start and keeps for its sessions' KV and "
        "forward passes, so a growing footprint reuses pages it holds instead of faulting fresh ones (at most the "
        "device budget and a quarter of the free memory; 0: none).",
    )
    max_sessions: int = Field(
        128,
        ge=1,
        description="Most sessions one replica (one GPU) holds; a worker of N replicas holds up to N x this. "
        "model-config.yaml's batchSize and maxNumSequence must be >= N x this + 8: llava-serve and the container "
        "raise them at start, llava-deploy writes them for the instance's GPUs.",
    )

    # --- request limits ---------------------------------------------------------------------
    max_new_tokens_cap: int = Field(1024, ge=1, description="Largest max_new_tokens (native; chat: the context's).")
    default_max_new_tokens: int = Field(
        256, ge=1, description="Native max_new_tokens when none is given; a chat answer's memory at its start."
    )
    context_policy: Literal["truncate", "error"] = Field(
        "truncate",
        description="When a turn does not fit the model's context: truncate (the oldest remembered turns leave "
        "it, then an unset max_new_tokens is clipped to the room left) or error (422 context_length_exceeded).",
    )
    truncation_headroom: float = Field(
        0.25, ge=0.0, le=0.9, description="Context share a truncation leaves free: the next turns reuse the KV."
    )
    max_prompt_chars: int = Field(16000, ge=1, description="Longest prompt (and system prompt) in characters.")
    max_prompt_tokens: int = Field(2048, ge=1, description="Longest prompt in tokens after templating.")
    max_images_per_session: int = Field(8, ge=1, description="Most images and videos one session holds, the first too.")
    max_image_tokens_per_session: int = Field(
        0, ge=0, description="Most image tokens (context positions) of all a session's images; 0: the context's."
    )
    max_body_bytes: int = Field(_SAGEMAKER_MAX_BODY_BYTES, ge=1, description="Largest body (SageMaker's: 6 MiB).")
    max_image_bytes: int = Field(20 * _MIB, ge=1, description="Largest encoded image in bytes (URL, S3 or base64).")
    max_image_pixels: int = Field(
        40_000_000, ge=1, description="Largest decoded image in pixels (width x height); decompression-bomb guard."
    )
    # --- videos (each frame: the vision tower and 196 context tokens on LLaVA-OneVision) -----
    max_video_bytes: int = Field(64 * _MIB, ge=1, description="Largest encoded video in bytes (URL, S3 or base64).")
    video_num_frames: int = Field(8, ge=1, description="Frames sampled from a video whose request names none.")
    max_video_frames: int = Field(32, ge=1, description="Most frames sampled from one video (32: 6,273 tokens).")

    # --- image fetching ---------------------------------------------------------------------
    allow_http: bool = Field(False, description="Accept plain http:// image URLs (https is always accepted).")
    allow_private_networks: bool = Field(
        False, description="Accept loopback and private image URL targets (dev, tests; link-local/metadata refused)."
    )
    url_allowlist: tuple[str, ...] = Field(
        (), description='If set, only these image URL hosts: exact ("img.example.com") or suffix (".example.com").'
    )
    fetch_connect_timeout_s: float = Field(5.0, gt=0.0, description="Image URL and S3 connect timeout, seconds.")
    fetch_read_timeout_s: float = Field(20.0, gt=0.0, description="Image URL and S3 socket read timeout, seconds.")
    fetch_total_timeout_s: float = Field(25.0, gt=0.0, description="Deadline of a whole image fetch, seconds.")
    max_redirects: int = Field(3, ge=0, description="Most HTTP redirects followed for an image URL.")
    image_fetch_workers: int = Field(4, ge=1, le=64, description="Threads fetching images beside the loop.")
    image_fetch_wait_ms: int = Field(
        250, ge=0, le=60_000, description="While answers generate, wait this long for a new request's image fetch."
    )
    image_memory_bytes: int = Field(256 * _MIB, ge=0, description="Bytes of fetched images the proxy keeps (0: none).")
    image_memory_ttl_s: float = Field(600.0, gt=0.0, description="How long the proxy keeps a fetched image, seconds.")

    # --- scheduling -------------------------------------------------------------------------
    max_concurrent_generations: int = Field(
        0, ge=0, description="Generations in flight per worker, then requests wait; 0: 16 on a CPU, 64 on a GPU."
    )
    queue_max_requests: int = Field(256, ge=0, description="Requests the public port holds for a slot (0: none).")
    queue_timeout_s: float = Field(30.0, gt=0.0, description="Longest a held request waits, seconds; then 503.")
    step_max_tokens: int = Field(1, ge=1, description="Most tokens one call advances each generation (a chunk).")
    step_token_budget: int = Field(
        0,
        ge=0,
        description="0 = adaptive: a step's prefill is sized in time from each forward pass's measured cost "
        "(max_step_ms_while_decoding, max_prefill_tokens_per_pass). A number fixes it in tokens (vLLM's "
        "max_num_batched_tokens): decode rows first, then prefill chunks (at least 16 tokens).",
    )
    max_step_ms_while_decoding: float = Field(
        150.0,
        gt=0.0,
        le=60_000.0,
        description="While answers decode, the most ms one step takes (their inter-token "
        "gap): new prompts prefill in chunks that fit beside the decode step. Adaptive budget only.",
    )
    max_step_ratio_while_opening: float = Field(
        2.0,
        ge=1.0,
        le=1000.0,
        description="While answers decode, a step that prefills an open or an added image (no first token waits on "
        "it) takes at most this many decode steps alone (2: their gap at most doubles). Adaptive budget only.",
    )
    max_prefill_tokens_per_pass: int = Field(
        8192, ge=16, description="Most prompt tokens one prefill pass runs (activation memory). Adaptive budget only."
    )
    step_max_ms: float = Field(100.0, gt=0.0, description="Most ms one scheduler call spends before replying.")
    fuse_prefill: bool = Field(True, description="While answers decode, a prefill chunk rides their forward pass.")
    enforce_eager: bool = Field(False, description="No CUDA graphs: a GPU's decode steps and prefills run eagerly.")
    async_scheduling: bool = Field(True, description="A GPU's CUDA-graph decode steps run one step ahead of the host.")
    image_preprocessing: Literal["host", "device"] = Field("host", description="Where llava-1.5 resizes images.")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="Text layers fused and compiled (Inductor) before graphs are captured; 'auto': on a GPU."
    )

    # --- misc -------------------------------------------------------------------------------
    system_prompt: str | None = Field(
        None, description="Default system prompt when open_session or a chat request's messages give none."
    )
    share_images: bool = Field(
        True,
        description="Sessions and chat requests without a session on one worker reuse each other's image features "
        "and conversation-prefix KV cache, matched by the image's exact bytes, within equal cache_salts (see "
        "unsalted_cache); false keeps each session to its own whatever the salt, and turns the conversation cache off.",
    )
    conversation_cache_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of the device budget that chat requests without a session may keep as conversation-"
        "cache entries (their images, features and KV, so the conversation resent with its next turn prefills only "
        "what is new, as vLLM's prefix cache); entries go first, oldest first, whenever room is needed, and a "
        "session is never demoted for one. 0 = off.",
    )
    conversation_cache_entries: int = Field(
        64, ge=0, description="Most conversation-cache entries one worker holds (oldest dropped first)."
    )
    unsalted_cache: Literal["shared", "isolated"] = Field(
        "shared",
        description="What requests without a cache_salt share: 'shared' (as vLLM: every unsalted request may reuse "
        "the image features, stored images, image uuids and prefix KV of every other unsalted one, so a client can "
        "time whether another sent an image) or 'isolated' (nothing beyond their own session; no conversation "
        "cache for them). Requests with a cache_salt share only with an equal salt either way.",
    )
    served_model_name: tuple[str, ...] = Field(
        (),
        description="Names the model answers to on OpenAI's /v1 route (vLLM's --served-model-name; /invocations "
        "takes any): another gets 404 model_not_found; a reply carries the one its request named, else the first; "
        "empty: the checkpoint folder's name.",
    )
    metrics_interval_ms: int = Field(
        1000,
        ge=0,
        description="Most often the worker writes its metric lines, in ms (values of the calls in between are "
        "merged into the next write); 0 = after every call. TorchServe's frontend parses each line on the CPUs "
        "that serve the requests.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = Field(
        "WARNING", description="Log level of the llava_sessions loggers."
    )

    # ---------------------------------------------------------------------------------------
    @field_validator("device", "dtype", "compile", "image_preprocessing", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:  # YAML 1.1 (PyYAML, TorchServe's too) reads a bare on/off as a boolean
        value = {True: "on", False: "off"}[value] if isinstance(value, bool) else value
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("devices", mode="before")
    @classmethod
    def _check_devices(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        value = value.strip().lower().replace(" ", "")
        if value == "auto":
            return value
        items = value.split(",")
        bad = [d for d in items if not _DEVICE_RE.match(d)]
        if not items or bad:
            raise ValueError(f'{bad or value!r}: give "auto" or a comma-separated list of cpu, cuda, cuda:N')
        return ",".join(items)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("url_allowlist", mode="before")
    @classmethod
    def _split_allowlist(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, (list, tuple)):
            entries = []
            for item in value:
                if not isinstance(item, str):
                    raise ValueError("entries must be host names (strings)")
                item = item.strip().lower()
                if item.endswith(".") and not item.endswith(".."):
                    item = item[:-1]  # a fully qualified name's root dot
                if not item:
                    continue
                if not _HOST_RE.match(item):
                    raise ValueError(
                        f"{item!r} is not a host name; give bare hosts like 'img.example.com' or "
                        "'.example.com' (no scheme, port or path)"
                    )
                entries.append(item)
            return tuple(entries)
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> Settings:
        if self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) must be <= max_new_tokens_cap "
                f"({self.max_new_tokens_cap}); lower the default or raise the cap"
            )
        if self.gpu_id is not None and self.device == "cpu":
            raise ValueError("gpu_id is set but device is 'cpu'; unset gpu_id or use device 'cuda'/'auto'")
        return self

    # ---------------------------------------------------------------------------------------
    @classmethod
    def from_sources(cls, handler_section: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> Settings:
        """Build settings from the yaml ``handler:`` section, then ``LLAVA_*`` environment overrides.

        Args:
            handler_section: the ``handler:`` mapping of TorchServe's model-config.yaml
                (``context.model_yaml_config.get("handler")``), or None. Keys are field names.
                Keys that are not fields raise; TorchServe's own handler keys are not accepted,
                so keep other components' settings out of this section.
            env: environment to read overrides from (``os.environ`` in production). Only
                ``LLAVA_<FIELD>`` variables named after a field are read; any other ``LLAVA_*``
                variable but the tools' own (:data:`TOOL_ENV_VARS`) is refused as a typo. Values: ints, floats, booleans (1/0, true/false, yes/no,
                on/off), comma-separated lists; an empty value or ``none`` clears an optional field.

        Raises:
            ValueError: an unknown yaml key (the message lists valid keys), an unknown ``LLAVA_*``
                variable (with the closest setting's variable), an unparsable
                environment value, or a value out of range (the message names each key or
                variable and what to fix).
        """
        raw: dict[str, Any] = {}
        origin: dict[str, str] = {}
        fields = cls.model_fields
        if handler_section:
            if not isinstance(handler_section, Mapping):
                raise ValueError("model-config.yaml 'handler:' section must be a mapping of setting names to values")
            cls.check_names(handler_section, "in model-config.yaml handler section")
            for key, value in handler_section.items():
                raw[key] = value
                origin[key] = f"handler.{key}"
        if env is not None:
            _check_env_names(env, fields)
        for name in fields:
            var = ENV_PREFIX + name.upper()
            if env is not None and var in env:
                raw[name] = _parse_env(name, var, env[var], fields[name].annotation)
                origin[name] = var
        try:
            settings = cls(**raw)
        except ValidationError as exc:
            raise ValueError(_describe(exc, origin)) from None
        return settings

    @classmethod
    def check_names(cls, keys: Iterable[Any], where: str) -> None:
        """Refuse keys that name no setting: ``where`` says where they came from (``"in --set"``).

        Raises:
            ValueError: ``unknown key(s) <where>: session_tl_s (did you mean session_ttl_s?)``, then where
                every setting is listed, or, for a key like none, the valid keys.
        """
        _refuse_removed(str(k) for k in keys)
        fields, unknown = cls.model_fields, sorted(str(k) for k in keys if k not in cls.model_fields)
        hinted = with_hints(unknown, fields)
        close = all("(did you mean" in h for h in hinted)
        rest = "every setting: docs/configuration.md" if close else f"valid keys: {', '.join(fields)}"
        if unknown:
            raise ValueError(f"unknown key(s) {where}: {', '.join(hinted)}; {rest}")

    @classmethod
    def env_table(cls) -> str:
        """Return a markdown table of every setting: env var, field, default, description."""
        lines = ["| env var | field | default | description |", "|---|---|---|---|"]
        for name, info in cls.model_fields.items():
            default = info.default
            if isinstance(default, tuple):
                shown = ",".join(default) if default else "(empty)"
            elif default is None:
                shown = "(unset)"
            elif isinstance(default, str) and default == "":
                shown = '""'
            elif isinstance(default, bool):
                shown = str(default).lower()
            elif isinstance(default, int) and default >= _GIB and default % _GIB == 0:
                shown = f"{default} ({default // _GIB} GiB)"
            elif isinstance(default, int) and default >= _MIB and default % _MIB == 0:
                shown = f"{default} ({default // _MIB} MiB)"
            else:
                shown = str(default)
            desc = (info.description or "").replace("|", "\\|")
            lines.append(f"| `{ENV_PREFIX}{name.upper()}` | `{name}` | `{shown}` | {desc} |")
        return "\n".join(lines) + "\n"


def _parse_env(name: str, var: str, text: str, annotation: Any) -> Any:
    """Turn one environment string into the field's Python type (validation comes later)."""
    value = text.strip()
    args = get_args(annotation)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if optional else annotation
    if optional and value.lower() in _NONE:
        return None
    if get_origin(base) is tuple:
        return [part.strip() for part in value.split(",") if part.strip()]
    try:
        if base is bool:
            lowered = value.lower()
            if lowered in _TRUE | _FALSE:
                return lowered in _TRUE
            raise ValueError
        if base is int:
            return int(value)
        if base is float:
            return float(value)
    except ValueError:
        kind = {bool: "a boolean (true/false, 1/0, yes/no, on/off)", int: "an integer", float: "a number"}[base]
        raise ValueError(f"{var}={text!r}: {name} must be {kind}") from None
    if base is str and optional:
        return text  # free text (system_prompt): keep it as written
    return value


def _describe(exc: ValidationError, origin: Mapping[str, str]) -> str:
    """Render a settings ValidationError as one message naming where each bad value came from."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = err["loc"]
        name = str(loc[0]) if loc else ""
        where = origin.get(name, name) if name else "settings"
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if name and isinstance(value, (int, float, str)) and name != "system_prompt" and len(str(value)) <= 64:
            msg = f"{msg} (got {value!r})"
        label = where if where == name else f"{name} (from {where})"
        parts.append(f"{label}: {msg}" if name else msg)
    return "invalid settings: " + "; ".join(parts)


def _check_env_names(env: Mapping[str, str], fields: Iterable[str]) -> None:
    """Refuse ``LLAVA_*`` variables that name no setting and are not the tools' (a typo would be ignored).

    Raises:
        ValueError: naming each such variable and the closest setting's variable.
    """
    _refuse_removed(k[len(ENV_PREFIX) :].lower() for k in env if k.startswith(ENV_PREFIX))
    known = {ENV_PREFIX + name.upper() for name in fields}
    unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known and k not in TOOL_ENV_VARS)
    if unknown:
        raise ValueError(
            f"unknown environment variable(s): {', '.join(with_hints(unknown, sorted(known)))}; a setting's "
            f"variable is {ENV_PREFIX}<SETTING NAME> (docs/configuration.md lists them)"
        )


def _refuse_removed(names: Iterable[str]) -> None:
    """Raises ValueError (one line) for a :data:`REMOVED_SETTINGS` key among ``names``."""
    for name in (n for n in names if n in REMOVED_SETTINGS):
        raise ValueError(f"the {name} setting is gone ({REMOVED_SETTINGS[name]} on every device); delete it")


def with_hints(unknown: list[str], valid: Iterable[str]) -> list[str]:
    """Each unknown key, with the closest valid one (``difflib``): ``session_tl_s (did you mean session_ttl_s?)``."""
    names = list(valid)
    hints = [(key, difflib.get_close_matches(key, names, n=1, cutoff=0.75)) for key in unknown]
    return [f"{key} (did you mean {close[0]}?)" if close else key for key, close in hints]


def resolve_devices(settings: Settings, *, cuda_count: int | Callable[[], int] | None = None) -> list[str]:
    """The devices of this worker's replicas, from ``settings.devices``.

    ``auto``: one replica per ``tensor_parallel_size`` visible GPUs when ``device`` is not ``cpu`` and
    no ``gpu_id`` is set (two or more such groups), else one replica on ``device`` / ``gpu_id`` (``""`` =
    the model's own choice). An explicit list is used as given.

    Args:
        settings: validated settings.
        cuda_count: visible CUDA devices, or a function that counts them (called only when the
            count decides); default: ``torch.cuda.device_count()``.
    """
    if settings.devices != "auto":
        return settings.devices.split(",")
    if settings.device == "cpu" or settings.gpu_id is not None:
        return [""]
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count()
    elif callable(cuda_count):
        cuda_count = cuda_count()
    step = settings.tensor_parallel_size  # a replica's ranks take the GPUs after its own
    return [f"cuda:{i}" for i in range(0, cuda_count - step + 1, step)] if cuda_count >= 2 * step else [""]
