"""What a local TorchServe is given (the model config, ``config.properties``, the no-archive model
folder, the environment) and what it says back (its workers' states, their logs), the same way for
``llava-serve``, the container and ``llava-deploy``.

Facts: docs/platform.md (sequence header keys set twice, body limits,
``--extra-files`` copying a folder's contents).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

import llava_sessions
from llava_sessions.wire.contract import NEW_SESSION_ID_HEADER, SEQUENCE_END_HEADER, SESSION_ID_HEADER

from ..cli import StartError
from ..processes import OPENER, bearer, load_psutil

if TYPE_CHECKING:
    from llava_sessions.config import Settings

__all__ = [
    "CPU_MAX_BATCH_DELAY_MS",
    "JVM_ARGS",
    "MAX_REQUEST_BYTES",
    "MAX_RESPONSE_BYTES",
    "MODEL_NAME",
    "MULTI_WORKER_REFUSAL",
    "SEQUENCE_HEADER_KEYS",
    "ServerStartError",
    "archive",
    "child_env",
    "console_script",
    "config_properties",
    "default_handler_path",
    "default_log_config_path",
    "default_model_config_path",
    "keep_logs",
    "load_failed",
    "model_config",
    "model_status",
    "visible_gpus",
    "worker_error",
    "worker_pids_of",
]

#: Name the model is registered under (``/predictions/llava``; ``/invocations`` needs no name).
MODEL_NAME = "llava"

#: Frontend keys (config.properties) -> the env var the Python worker reads the same name from
#: (ts/context.py, Context.__init__). Both sides must name the same header: SageMaker's session id
#: header doubles as TorchServe's sequence id key; the start key is the new-session header (a request
#: header the frontend adds); the end key is our own (contract.SEQUENCE_END_HEADER), so ending a job
#: group TorchServe minted never tells a client that a session closed.
SEQUENCE_HEADER_KEYS = (
    ("ts_header_key_sequence_id", "TS_REQUEST_SEQUENCE_ID", SESSION_ID_HEADER),
    ("ts_header_key_sequence_start", "TS_REQUEST_SEQUENCE_START", NEW_SESSION_ID_HEADER),
    ("ts_header_key_sequence_end", "TS_REQUEST_SEQUENCE_END", SEQUENCE_END_HEADER),
)

#: TorchServe's request limit, bytes: far above SageMaker's 6,291,456 so that the handler, not
#: TorchServe's bare 413, refuses a body over the handler's ``max_body_bytes`` (with the dialect's
#: typed ``payload_too_large``); llava-serve's proxy answers past this one the same way.
MAX_REQUEST_BYTES = 64 << 20
#: TorchServe's response limit, bytes (replies are small; SageMaker's limit sits just under it).
MAX_RESPONSE_BYTES = 6_553_600
#: The frontend's JVM options (``vmargs``): C1 only and the serial collector. The frontend relays bytes
#: and queues jobs; with the default tiered JIT its C2 compiler threads were still compiling after
#: hundreds of requests, and with G1 its collector threads woke too. Measured on the 2-core CPU during
#: 8-stream bursts (docs/decisions/25-the-serving-stack-s-share-of-two-cores.md): the Java process's CPU
#: 0.60-0.77 s a burst with the defaults, 0.40-0.49 s with these.
JVM_ARGS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: Minutes TorchServe's token keys live when its token authorization is on (100 years: TorchServe's
#: default, 60, would lock the server's own proxy out of a server that runs longer).
TOKEN_EXPIRATION_MIN = 52_560_000
#: The file TorchServe writes its token keys to, in its working directory (``user.dir``).
KEY_FILE = "key_file.json"
#: TorchServe's ``maxBatchDelay`` (ms) for a worker whose replicas all run on the CPU (model-config.yaml's
#: 1 ms is for a GPU's). TorchServe 0.12's sequence-batching dispatcher wakes every ``maxBatchDelay``
#: whatever the load (``SequenceBatching.EventDispatcher``: a timed poll, then a no-op task handed to a
#: pool thread): at 1 ms 0.19-0.25 CPU-s of a 5 s burst on the 2-core CPU, taken from the forward
#: pass's threads; 2 ms halves it. A request reaching an idle worker waits the delay once: a 1-token
#: answer's serving overhead went from 3.64 to 4.47 ms (docs/decisions/25-the-serving-stack-s-share-of-two-cores.md),
#: nothing beside a CPU forward pass's tens to hundreds of ms.
CPU_MAX_BATCH_DELAY_MS = 2
#: Why more than one TorchServe worker per model is refused (docs/decisions/42-one-worker.md).
MULTI_WORKER_REFUSAL = (
    "more than one TorchServe worker per model is refused: TorchServe does not keep a session on one "
    "worker when clients send the literal id NEW_SESSION (one shared job group; their follow-ups reach "
    "the other worker and get 404), and it does not balance sessions over workers. Run one worker; for "
    "more model copies run llava-local-endpoint --backends N"
)

#: The worker core (the only package the TorchServe worker imports) and the handler folder beside it.
CORE_DIR = Path(llava_sessions.__file__).resolve().parent
#: The project folder (``handler/``, ``config/``, ``model-config.yaml``): ``$LLAVA_HOME`` (the image's
#: ``/opt/llava``; a non-editable install), else the source checkout the worker core runs from.
REPO_ROOT = Path(os.environ["LLAVA_HOME"]) if os.environ.get("LLAVA_HOME") else CORE_DIR.parent.parent


#: Seconds between reads of a log that is being waited for.
POLL_S = 0.25


class ServerStartError(StartError):
    """TorchServe could not be prepared or did not become ready; the message ends with a log tail."""


def console_script(name: str) -> str:
    """Return the console script ``name`` of this interpreter's environment, else from PATH.

    Raises:
        ServerStartError: neither has it (the 'serve' extra is not installed).
    """
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerStartError(f"{name} not found; install the 'serve' extra (torchserve 0.12.0)")
    return found


def default_handler_path() -> Path:
    """Return the path of the TorchServe entry ``handler/llava_handler.py`` of the project folder."""
    return REPO_ROOT / "handler" / "llava_handler.py"


def default_model_config_path() -> Path:
    """Return the path of the repository's ``model-config.yaml``."""
    return REPO_ROOT / "model-config.yaml"


def default_log_config_path(home: Path | None = None) -> Path | None:
    """TorchServe's log4j2 configuration: ``$LLAVA_TS_LOG_CONFIG``, else the quiet
    ``config/log4j2.xml`` of ``home`` (default: the repository), else None (TorchServe's own,
    which logs every request at DEBUG)."""
    named = os.environ.get("LLAVA_TS_LOG_CONFIG", "").strip()
    if named:
        return Path(named)
    path = (home or REPO_ROOT) / "config" / "log4j2.xml"
    return path if path.is_file() else None


def visible_gpus(env: Mapping[str, str] | None = None) -> int:
    """CUDA devices a worker started with ``env`` would see: 0 where no NVIDIA driver is loaded
    (no ``/proc/driver/nvidia``), else ``torch.cuda.device_count()`` counted in a child process, so
    this supervisor never imports torch nor touches CUDA (``CUDA_VISIBLE_DEVICES`` in ``env``
    applies). 0 when the count fails."""
    if not Path("/proc/driver/nvidia").exists():
        return 0
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(env) if env is not None else None,
        )
        return int(done.stdout.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def read_model_config(path: Path) -> dict[str, Any]:
    """``path``'s model-config.yaml: TorchServe's keys at the top, the handler's settings under
    ``handler:`` (an empty mapping when there is none).

    Raises:
        ValueError: not YAML, not a mapping, or a ``handler:`` that is not a mapping (the message names
            the file). OSError: the file cannot be read.
    """
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a YAML mapping")
    section = config.get("handler") or {}
    if not isinstance(section, dict):
        raise ValueError(f"{path}: its handler: section must be a mapping of settings")
    config["handler"] = dict(section)
    return config


def model_config(
    source: Path,
    *,
    model_dir: Path,
    workers: int,
    overrides: Mapping[str, Any],
    model_config_overrides: Mapping[str, Any],
    env: Mapping[str, str],
) -> dict[str, Any]:
    """The model-config.yaml a local TorchServe gets: ``source`` with ``workers`` workers, the
    top-level ``model_config_overrides``, ``handler.model_dir`` and the handler ``overrides``, with
    job groups for what the worker's replicas may hold and a CPU worker's batch delay
    (:func:`fit_to_devices`).

    Raises:
        ServerStartError: ``source`` is not a YAML mapping (:func:`read_model_config`).
    """
    try:
        config = read_model_config(source)
    except ValueError as exc:
        raise ServerStartError(str(exc)) from None
    config["minWorkers"] = workers
    config["maxWorkers"] = workers
    config.update(model_config_overrides)
    config["handler"] = {**config["handler"], "model_dir": str(model_dir), **overrides}
    fit_to_devices(config, keep=set(model_config_overrides), env=env)
    return config


def fit_to_devices(config: dict[str, Any], *, keep: set[str], env: Mapping[str, str]) -> None:
    """Fit the TorchServe keys (in place) to the worker's replicas. ``batchSize`` and ``maxNumSequence``
    are raised to what they may hold (:func:`~llava_sessions.config.job_groups`): ``max_sessions`` is
    per replica, and ``devices: auto`` starts one replica per visible GPU (:func:`visible_gpus`), so a
    4-GPU instance with the shipped 64 gets 264. ``maxBatchDelay`` is raised to
    :data:`CPU_MAX_BATCH_DELAY_MS` when every replica runs on the CPU. Keys named in ``keep`` stay as
    given; ``env``: the worker's environment (``LLAVA_*``)."""
    from llava_sessions.config import Settings, job_groups, resolve_devices

    count = functools.cache(lambda: visible_gpus(env))  # nvidia-smi once, and only when a count decides
    settings = Settings.from_sources(config["handler"], env)
    devices = resolve_devices(settings, cuda_count=count)
    need = job_groups(settings.max_sessions, len(devices))
    for key in ("batchSize", "maxNumSequence"):
        if key not in keep and int(config.get(key) or 0) < need:
            config[key] = need
    if "maxBatchDelay" not in keep and cpu_only(settings.device, devices, count):
        config["maxBatchDelay"] = max(int(config.get("maxBatchDelay") or 0), CPU_MAX_BATCH_DELAY_MS)


def cpu_only(device: str, devices: list[str], cuda_count: Callable[[], int]) -> bool:
    """Whether every replica of ``devices`` (:func:`~llava_sessions.config.resolve_devices`'s, where
    ``""`` is the runner's own choice of ``device``: ``auto`` takes a GPU when one is visible) runs on
    the CPU; ``cuda_count`` counts the visible GPUs, called only when that decides."""
    if any(devices):
        return all(d.split(":")[0] == "cpu" for d in devices)
    return device == "cpu" or (device == "auto" and cuda_count() == 0)


def child_env(extra: Mapping[str, str], tmp: Path) -> dict[str, str]:
    """The environment of TorchServe and its workers: this process's, ``extra``, the sequence header
    names the worker reads, and ``tmp`` as TMPDIR / TEMP (the archiver's staging dir, the launcher's
    pid file, and ``java.io.tmpdir``, where the frontend puts the workers' unix sockets)."""
    env = dict(os.environ)
    env.pop("TS_CONFIG_FILE", None)  # the launcher would prefer it over --ts-config
    env.update(extra)
    for _, env_name, header in SEQUENCE_HEADER_KEYS:
        env[env_name] = header
    env["TMPDIR"] = str(tmp)
    env["TEMP"] = str(tmp)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def archive(handler: Path, model_config_path: Path, store: Path, temp: Path, env: dict[str, str]) -> None:
    """Write the no-archive model folder ``store/llava`` with ``torch-model-archiver``: the
    ``handler`` file, the worker core as the package ``llava_sessions/`` beside it, the config.

    Raises:
        ServerStartError: the archiver failed (its stderr in the message).
    """
    # --extra-files copies a directory's CONTENTS into the model root; stage the package one
    # level down so it lands as <model>/llava_sessions/ and stays importable as a package.
    extra = temp / "extra"
    shutil.copytree(CORE_DIR, extra / CORE_DIR.name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    command = [
        console_script("torch-model-archiver"),
        "--model-name",
        MODEL_NAME,
        "--version",
        "1.0",
        "--handler",
        str(handler.resolve()),
        "--extra-files",
        str(extra),
        "--config-file",
        str(model_config_path),
        "--archive-format",
        "no-archive",
        "--export-path",
        str(store),
    ]
    result = subprocess.run(command, cwd=temp, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ServerStartError(f"torch-model-archiver failed ({result.returncode}): {result.stderr.strip()}")


def config_properties(
    host: str, ports: Mapping[str, int], store: Path, workers: int, *, token_auth: bool = False
) -> str:
    """TorchServe's ``config.properties``: inference on ``host``, the other APIs on 127.0.0.1 at
    ``ports`` (:func:`~llava_tools.processes.pick_ports`), TorchServe's token authorization only with
    ``token_auth`` (its keys then never expire: :func:`token_keys`), Prometheus metrics with the
    handler's own registered as first emitted, the body limits, the sequence header keys, the JVM's
    options (:data:`JVM_ARGS`)."""
    lines = [
        "# Written by llava-serve for one local run.",
        f"inference_address=http://{host}:{ports['inference']}",
        f"management_address=http://127.0.0.1:{ports['management']}",
        f"metrics_address=http://127.0.0.1:{ports['metrics']}",
        "grpc_inference_address=127.0.0.1",
        f"grpc_inference_port={ports['grpc_inference']}",
        "grpc_management_address=127.0.0.1",
        f"grpc_management_port={ports['grpc_management']}",
        f"token_expiration_min={TOKEN_EXPIRATION_MIN}" if token_auth else "disable_token_authorization=true",
        "disable_system_metrics=true",
        "metrics_mode=prometheus",
        "model_metrics_auto_detect=true",
        f"model_store={store}",
        "load_models=ALL",
        f"default_workers_per_model={workers}",
        f"max_request_size={MAX_REQUEST_BYTES}",
        f"max_response_size={MAX_RESPONSE_BYTES}",
    ]
    lines += [f"{key}={header}" for key, _, header in SEQUENCE_HEADER_KEYS]
    lines.append(f"vmargs={JVM_ARGS}")
    return "\n".join(lines) + "\n"


def worker_error(log_dir: Path, wait_s: float = 5.0) -> str:
    """The worker's own error in model_log.log (``ValueError: ...``: the first exception line, the
    handler's; TorchServe's own follows it), or where to look. The frontend copies the worker's
    traceback a line at a time, after the line that says it died: wait up to ``wait_s`` for it."""
    model_log = log_dir / "model_log.log"
    deadline = time.monotonic() + wait_s
    while True:
        text = model_log.read_text(errors="replace") if model_log.is_file() else ""
        found = re.findall(r"MODEL_LOG - ((?:\w+\.)*\w*(?:Error|Exception): .*)$", text, re.M)
        if found:
            return found[0]
        if time.monotonic() > deadline:
            return f"see {model_log}"
        time.sleep(POLL_S)


def load_failed(log_dir: Path, wait_s: float = 0.0) -> bool:
    """Whether the handler's log says it failed to load, waiting up to ``wait_s`` for it to."""
    # TorchServe would restart the worker with back-off forever; a local run fails fast. TorchServe
    # 0.12 logs "Failed to load model" for a RuntimeError only; any other exception from the
    # handler's initialize kills the worker process ("Backend worker process died.").
    model_log = log_dir / "model_log.log"
    deadline = time.monotonic() + wait_s
    while True:
        text = model_log.read_text(errors="replace") if model_log.is_file() else ""
        if "Failed to load model" in text or "Backend worker process died" in text:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def token_keys(key_file: Path) -> dict[str, str]:
    """TorchServe's own keys, ``{"inference": ..., "management": ...}``, from the ``key_file.json`` it
    writes in its working directory at each launch while its token authorization is on (readable by
    its user alone); {} before it is written. Source: TorchServe's ``TokenAuthorization.java`` (0.12)."""
    try:
        written = json.loads(key_file.read_text())
        return {kind: str(written[kind]["key"]) for kind in ("inference", "management")}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def model_status(management_url: str, num_workers: int, key: str | None = None) -> tuple[bool, str, dict[int, str]]:
    """(every worker READY, a status line, each reported worker's state by pid) from TorchServe's
    management API (a worker not started yet reports pid -1 and is left out); ``key``: its
    management key while token authorization is on."""
    request = urllib.request.Request(f"{management_url}/models/{MODEL_NAME}", headers=bearer(key))
    try:
        with OPENER.open(request, timeout=2) as response:
            described = json.loads(response.read())
    except (OSError, ValueError) as exc:
        return False, f"management API: {exc}", {}
    workers = described[0].get("workers", []) if described else []
    states = [w.get("status") for w in workers]
    by_pid = {int(w["pid"]): str(w.get("status")) for w in workers if int(w.get("pid") or -1) > 0}
    return states.count("READY") >= num_workers, f"worker states {states}", by_pid


def worker_pids_of(frontend: Any) -> list[int]:
    """The pids of TorchServe's Python workers (``ts/model_service_worker.py`` processes) under the
    frontend's ``psutil.Process``, sorted; [] when it is gone."""
    psutil = load_psutil()
    pids = []
    try:
        children = frontend.children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            if any("model_service_worker" in part for part in child.cmdline()):
                pids.append(child.pid)
        except psutil.Error:
            continue
    return sorted(pids)


def keep_logs(temp_dir: Path) -> Path | None:
    """Move a server's ``logs`` folder out of ``temp_dir`` (about to be removed) to
    ``<tmp>/llava-serve-logs-<time>-<pid>``; returns where, or None (no logs, or the move failed)."""
    logs = temp_dir / "logs"
    if not logs.is_dir():
        return None
    kept = Path(tempfile.gettempdir()) / f"llava-serve-logs-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        shutil.move(str(logs), kept)
    except OSError:
        return None
    return kept


def tail_logs(temp_dir: Path, n: int = 50) -> str:
    """The last ``n`` lines of TorchServe's frontend log and of the handler's log under a server's
    ``temp_dir``: ``logs/ts_log.log`` is the frontend, ``logs/model_log.log`` what the worker (our
    handler) printed; before the frontend has created ``logs/`` the launcher's ``console.log``."""
    files = [temp_dir / "logs" / "ts_log.log", temp_dir / "logs" / "model_log.log"]
    if not any(path.is_file() for path in files):
        files = [temp_dir / "console.log"]
    parts = []
    for path in files:
        if path.is_file():
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"==> {path.name} <==\n" + "\n".join(lines))
    return "\n".join(parts)


#: The top-level keys of model-config.yaml TorchServe reads (its ``ModelConfig.java``, 0.12), with
#: ``handler`` (our settings) and ``pt2`` (read by its Python backend).
TORCHSERVE_MODEL_KEYS = frozenset(
    {
        "minWorkers", "maxWorkers", "batchSize", "maxBatchDelay", "responseTimeout", "startupTimeout",
        "deviceType", "parallelType", "parallelLevel", "deviceIds", "torchrun", "maxRetryTimeoutInSec",
        "clientTimeoutInMills", "jobQueueSize", "useJobTicket", "sequenceMaxIdleMSec", "sequenceTimeoutMSec",
        "maxSequenceJobQueueSize", "maxNumSequence", "continuousBatching", "sequenceBatching",
        "asyncCommunication", "useVenv", "handler", "pt2",
    }
)  # fmt: skip


def check_settings(
    config_path: Path,
    overrides: Mapping[str, Any],
    env: Mapping[str, str],
    model_config_overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """The handler settings a worker will read (the config's ``handler:`` section, the
    ``overrides``, ``LLAVA_*`` variables of ``env``), validated as the worker would, before anything
    starts; the config's top-level keys and ``model_config_overrides`` must be TorchServe's
    (:data:`TORCHSERVE_MODEL_KEYS`: it ignores a misspelt one without a word).

    Raises:
        ServerStartError: a setting or TorchServe key is unknown (with the closest valid key), or a
            setting is out of range.
    """
    from llava_sessions.config import Settings, with_hints  # noqa: F811 - at run time, not at import

    try:
        config = read_model_config(config_path)
    except ValueError as exc:
        raise ServerStartError(str(exc)) from None
    for keys, where in (
        (config, str(config_path)),
        (model_config_overrides or {}, "--ts-set"),
    ):
        unknown = sorted(str(k) for k in keys if k not in TORCHSERVE_MODEL_KEYS)
        if unknown:
            raise ServerStartError(
                f"unknown TorchServe key(s) in {where}: {', '.join(with_hints(unknown, TORCHSERVE_MODEL_KEYS))}; "
                f"TorchServe reads: {', '.join(sorted(TORCHSERVE_MODEL_KEYS))}"
            )
    section = {**config["handler"], **overrides}
    try:
        Settings.check_names(dict(overrides), "in --set")
        return Settings.from_sources(section, env)
    except ValueError as exc:
        raise ServerStartError(f"invalid handler settings: {exc}") from None
