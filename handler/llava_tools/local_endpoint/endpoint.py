"""A SageMaker-runtime look-alike on 127.0.0.1 over N local TorchServes: ``llava-local-endpoint``.

A development and test tool, NOT a production router: it lets unmodified boto3 code (and
``llava_client.SageMakerTransport``) talk to several real TorchServe backends the way it would talk
to a multi-instance SageMaker endpoint with stateful sessions::

    llava-local-endpoint --model-dir models/tiny --backends 2 --port 8090

    rt = boto3.client("sagemaker-runtime", endpoint_url="http://127.0.0.1:8090", region_name="us-east-1",
                      aws_access_key_id="x", aws_secret_access_key="x")
    opened = rt.invoke_endpoint(EndpointName="any", Body=b'{"type": "open_session", ...}',
                                ContentType="application/json", SessionId="NEW_SESSION")
    session_id = opened["NewSessionId"].split(";")[0]

What it does, and what SageMaker is believed to do (botocore's service model is verified; the rest
mirrors public AWS material and is unverified against a live endpoint):

- ``POST /endpoints/{name}/invocations`` and ``.../invocations-response-stream``; any endpoint name
  is accepted unless ``--endpoint-name`` is given (others then get ``ValidationError``).
- ``--routing prefix-aware`` (SageMaker's ``PREFIX_AWARE``, ``--prefix-length``,
  ``--concurrency-threshold``): a request without a session goes to the backend that served the same
  ``PrefixAwareId`` and first ``PrefixLength`` body bytes last (on the OpenAI route: characters of
  the messages' text), so a stateless conversation resent with its bytes finds its conversation cache;
  unless that backend has ``ConcurrencyThreshold`` requests outstanding. Default: least loaded.
- ``POST /endpoints/{name}/openai/v1/chat/completions``: SageMaker's OpenAI-compatible route (the
  ``openai`` package's ``base_url`` is ``.../endpoints/{name}/openai/v1``), sent to ``/invocations``
  and answered with the container's own reply (an SSE stream relayed as it comes).
- Sticky sessions by ``X-Amzn-SageMaker-Session-Id``. ``NEW_SESSION`` (or no id) goes to the
  least-loaded healthy backend (fewest sessions this router placed there). ``NEW_SESSION`` is
  forwarded as no header, so TorchServe mints ``ts-seq-<uuid>``: the AWS TorchServe sample's
  notebook asserts exactly that of a real endpoint. ``--new-session-literal`` forwards the literal
  header instead (TorchServe puts every such open in its one ``NEW_SESSION`` job group and the
  handler mints ``llava-<uuid4>``); an absent id is always forwarded absent. Either way the
  handler answers ``X-Amzn-SageMaker-New-Session-Id`` and the router remembers id → backend. A
  known id goes to its backend. An id the router does not know goes to the least-loaded backend as
  is; the container answers ``404 session_not_found`` with the Closed header (as an instance that
  does not hold the session would). ``X-Amzn-SageMaker-Closed-Session-Id`` in a reply forgets the
  session.
- Replies: the container's body and ``Content-Type``; ``X-Amzn-SageMaker-New-Session-Id`` /
  ``-Closed-Session-Id`` passed through (boto3 ``NewSessionId`` / ``ClosedSessionId``);
  ``x-Amzn-Invoked-Production-Variant: AllTraffic``; a fresh ``x-amzn-RequestId``.
- A container status >= 400 becomes SageMaker's ``ModelError``: HTTP 424, header
  ``x-amzn-ErrorType: ModelError:...`` (botocore takes the error code from it), JSON body with
  ``ErrorCode`` (``CLIENT_ERROR_FROM_MODEL`` for 4xx, ``INTERNAL_FAILURE_FROM_MODEL`` for 5xx),
  ``Message`` (``Received client error (404) from primary with message "..."``),
  ``OriginalStatusCode`` (int) and ``OriginalMessage`` (the container's body), ``LogStreamArn``.
  boto3 raises ``client.exceptions.ModelError`` with ``e.response["OriginalStatusCode"]``.
- A backend that is gone (connection refused, reset, or closed before answering). CHOICE: its
  sessions are lost, as they are when a SageMaker instance dies, and the client must see
  "session gone" quickly rather than a hang or a generic 5xx. The request that finds it down gets
  ``ModelError`` with ``OriginalStatusCode 404`` and ``OriginalMessage``
  ``{"error": {"code": "session_not_found", ...}}`` plus the Closed header; the router forgets every
  session of that backend (later requests with those ids reach a live backend, which answers the
  same 404) and sends new sessions elsewhere until the backend's ``/ping`` answers 200 again.
  A new session whose backend refuses the connection is retried on another backend (nothing was
  sent); with none left the reply is ``ServiceUnavailable`` (503).
- Streaming: the reply is ``application/vnd.amazon.eventstream``; each piece of the container's
  chunked body is sent as it arrives as one ``PayloadPart`` event (headers ``:event-type PayloadPart``,
  ``:message-type event``, ``:content-type application/octet-stream``; the payload IS the raw bytes,
  since ``PayloadPart.Bytes`` is an ``eventpayload`` blob), with prelude and message CRC32s.
  The container's Content-Type goes in ``X-Amzn-SageMaker-Content-Type``. An error before the
  first byte is a plain ``ModelError`` reply; a failure mid-stream is a ``ModelStreamError``
  exception event (``ErrorCode: StreamBroken``), which boto3 raises as ``EventStreamError``.
  ``NEW_SESSION`` is refused here (``ValidationError``), as SageMaker does.
- Bodies over 6 MiB (6,291,456 bytes) and session ids outside botocore's pattern
  ``^[a-zA-Z0-9](-*[a-zA-Z0-9])*$`` are refused with ``ValidationError``.
- ``GET /ping``: 200 while at least one backend's ``/ping`` answers 200 (a backend's proxy says 200
  only while its worker serves), else 503; the router listens only once every backend served.
  ``GET /debug/sessions``: ``{"backends": [{"index", "url", "healthy", "sessions", "log_dir"}],
  "sessions": {id: index}}``.

SIGINT / SIGTERM stop the HTTP server and every TorchServe backend it started (each in its own
process group, TMPDIR and ports: :class:`~llava_tools.serve.server.LocalServer`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..cli import add_setting_arguments, port_number, run_until_signal
from ..serve import API_KEY_ENV, LocalServer, ServerStartError
from .routing import BackendRef, Router
from .runtime_front import DEFAULT_READ_TIMEOUT_S, RouterServer
from .sagemaker_wire import (
    MAX_BODY_BYTES,
    encode_event,
    model_error_body,
    payload_part_event,
    stream_error_event,
)

__all__ = [
    "MAX_BODY_BYTES",
    "BackendRef",
    "LocalEndpoint",
    "Router",
    "RouterServer",
    "encode_event",
    "main",
    "model_error_body",
    "payload_part_event",
    "stream_error_event",
]


class LocalEndpoint:
    """N :class:`LocalServer` backends behind a SageMaker-runtime-compatible router on loopback.

    Args:
        model_dir: checkpoint folder every backend serves.
        backends: number of TorchServe instances (each its own ports, TMPDIR, process group).
        port: router port on ``host``; 0 picks a free one.
        host: router bind address (loopback by default: this is a development tool).
        endpoint_name: accept only this endpoint name (default: any).
        read_timeout_s: seconds to wait on a backend read.
        verbose: log each request to stderr.
        pass_new_session: forward an open's literal ``NEW_SESSION`` header, or (False, the
            default) no header, so TorchServe mints the id; see :class:`RouterServer`.
        routing: ``least-outstanding`` (requests without a session: the backend with the fewest
            sessions) or ``prefix-aware`` (SageMaker's ``PREFIX_AWARE``: where the same
            ``PrefixAwareId`` and first ``prefix_length`` body bytes were served last, unless it has
            ``concurrency_threshold`` requests outstanding).
        **server_kwargs: keyword arguments of :class:`LocalServer` for every backend
            (``overrides``, ``model_config_overrides``, ``handler``, ``startup_timeout_s``, ...).

    Use as a context manager, or :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backends: int = 2,
        port: int = 0,
        host: str = "127.0.0.1",
        endpoint_name: str | None = None,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        verbose: bool = False,
        pass_new_session: bool = False,
        routing: str = "least-outstanding",
        prefix_length: int = 1024,
        concurrency_threshold: int = 1024,
        api_key: str | None = None,
        **server_kwargs: Any,
    ) -> None:
        if routing not in ("least-outstanding", "prefix-aware"):
            raise ValueError(f"routing must be least-outstanding or prefix-aware, got {routing!r}")
        if not 1024 <= prefix_length <= 65536 or not 1 <= concurrency_threshold <= 1024:
            raise ValueError("prefix_length must be 1024..65536 and concurrency_threshold 1..1024 (SageMaker's ranges)")
        self.routing, self.prefix_length, self.concurrency_threshold = routing, prefix_length, concurrency_threshold
        if backends < 1:
            raise ValueError(f"backends must be >= 1, got {backends}")
        # each backend stands for a container: its proxy (the truthful /ping) without the /v1 routes
        server_kwargs.setdefault("openai_routes", False)
        # with a key, each backend wants it too (its own port and TorchServe's): the router sends it
        self.servers = [LocalServer(model_dir, api_key=api_key, **server_kwargs) for _ in range(backends)]
        self.port = port
        self.host = host
        self.endpoint_name = endpoint_name
        self.read_timeout_s = read_timeout_s
        self.verbose = verbose
        self.pass_new_session = pass_new_session
        self.api_key = api_key or None
        self.router: Router | None = None
        self._httpd: RouterServer | None = None

    @property
    def url(self) -> str:
        """The router's base URL (``endpoint_url`` for boto3)."""
        if self._httpd is None:
            raise RuntimeError("not started")
        return self._httpd.url

    def start(self) -> LocalEndpoint:
        """Start every backend (in parallel), then the router. Stops everything on failure.

        Raises:
            ServerStartError: the router's port is taken (said before any backend starts), or a
                backend did not become ready (message holds its log tail).
        """
        if self.port:  # a taken port is said at once, not after every backend has loaded its model
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    probe.bind((self.host, self.port))
                except OSError as exc:
                    raise ServerStartError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        try:
            with ThreadPoolExecutor(len(self.servers)) as pool:
                for future in [pool.submit(server.start) for server in self.servers]:
                    future.result()
            refs = [BackendRef(i, s.url, str(s.log_dir)) for i, s in enumerate(self.servers)]
            self.router = Router(
                refs, prefix_aware=self.routing == "prefix-aware", concurrency_threshold=self.concurrency_threshold
            )
            self._httpd = RouterServer(
                (self.host, self.port),
                self.router,
                endpoint_name=self.endpoint_name,
                read_timeout_s=self.read_timeout_s,
                verbose=self.verbose,
                pass_new_session=self.pass_new_session,
                prefix_length=self.prefix_length,
                api_key=self.api_key,
            ).start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def running(self) -> bool:
        """Whether the router is serving (a stopped backend does not stop the endpoint)."""
        return self._httpd is not None

    def abort_start(self) -> None:
        """Make a :meth:`start` in progress give up soon (from a signal handler)."""
        for server in self.servers:
            server.abort_start()

    def stop(self) -> None:
        """Stop the router and every backend (in parallel). Idempotent."""
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.stop()
        with ThreadPoolExecutor(len(self.servers)) as pool:
            list(pool.map(lambda server: server.stop(), self.servers))

    def __enter__(self) -> LocalEndpoint:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# ---- CLI -------------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llava-local-endpoint",
        description="Development/test tool: a SageMaker-runtime-compatible endpoint on 127.0.0.1 that "
        "routes sticky sessions over N local TorchServe backends (not a production router).",
    )
    parser.add_argument("--model-dir", required=True, help="llava-hf checkpoint folder")
    parser.add_argument("--backends", type=int, default=2, help="TorchServe instances (default 2)")
    parser.add_argument("--port", type=port_number, default=8090, help="router port on 127.0.0.1 (0: any free port)")
    parser.add_argument("--endpoint-name", default=None, help="accept only this endpoint name (default: any)")
    add_setting_arguments(
        parser,
        handler_help="handler setting for every backend (repeatable)",
        torchserve_help="top-level model-config.yaml key for every backend (repeatable)",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for each backend")
    parser.add_argument(
        "--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, help="seconds to wait on a backend read"
    )
    parser.add_argument("--verbose", action="store_true", help="log every request")
    parser.add_argument(
        "--new-session-literal",
        dest="pass_new_session",
        action="store_true",
        help="forward an open's literal NEW_SESSION header (the handler mints llava-<uuid>); default: no header, "
        "so TorchServe mints ts-seq-<uuid>, as the AWS TorchServe sample's notebook shows a real endpoint does",
    )
    parser.add_argument(
        "--routing",
        choices=["least-outstanding", "prefix-aware"],
        default="least-outstanding",
        help="requests without a session: to the least-loaded backend, or as SageMaker's PREFIX_AWARE (where "
        "the same PrefixAwareId and first --prefix-length body bytes were served last)",
    )
    parser.add_argument("--prefix-length", type=int, default=1024, help="PREFIX_AWARE's PrefixLength, 1024..65536")
    parser.add_argument(
        "--concurrency-threshold", type=int, default=1024, help="PREFIX_AWARE's ConcurrencyThreshold, 1..1024"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require this key on every request but /ping (default: ${API_KEY_ENV}): boto3 signs with it "
        "as its aws_access_key_id, the openai package sends it as its api_key",
    )
    parser.add_argument("--handler", default=None, help=argparse.SUPPRESS)  # tests: another TorchServe handler
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``llava-local-endpoint`` until SIGINT/SIGTERM; returns the exit code."""
    args = _build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535 or args.backends < 1:
        print("llava-local-endpoint: --port must be 0..65535 and --backends >= 1", file=sys.stderr)
        return 2
    if not 1024 <= args.prefix_length <= 65536 or not 1 <= args.concurrency_threshold <= 1024:
        print(
            "llava-local-endpoint: --prefix-length must be 1024..65536, --concurrency-threshold 1..1024",
            file=sys.stderr,
        )
        return 2
    endpoint = LocalEndpoint(
        args.model_dir,
        backends=args.backends,
        port=args.port,
        endpoint_name=args.endpoint_name,
        read_timeout_s=args.read_timeout,
        verbose=args.verbose,
        pass_new_session=args.pass_new_session,
        routing=args.routing,
        prefix_length=args.prefix_length,
        concurrency_threshold=args.concurrency_threshold,
        api_key=args.api_key,
        overrides=dict(args.overrides),
        model_config_overrides=dict(args.model_config_overrides),
        startup_timeout_s=args.startup_timeout,
        handler=args.handler,
    )
    return run_until_signal(
        "llava-local-endpoint",
        endpoint,
        starting=f"starting {args.backends} TorchServe backend(s)",
        ready=lambda: "ready at {} (backends: {})".format(
            endpoint.url, ", ".join(f"{s.url} (logs {s.log_dir})" for s in endpoint.servers)
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
