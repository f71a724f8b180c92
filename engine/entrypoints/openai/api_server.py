"""OpenAI-compatible HTTP server over an EngineLoop (FastAPI + Server-Sent Events).

    python -m engine.entrypoints.openai.api_server --host 127.0.0.1 --port 8000 --model dummy:tiny

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not),
`POST /invocations` (either, by its body), `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`,
`GET /version`, `GET /health`, `GET /metrics` (Prometheus text format).

- `build_app(loop, api_key=None, ...)` returns a FastAPI app serving one EngineLoop.
- With an API key, everything the app serves needs it except `/health` (auth.py): the API, /metrics, and a
  UI mounted beside them. Connections are guarded by read timeouts and a connection cap (connection.py).
- `register(app, get_loop, api_key=None, ...)` adds the same routes to an existing FastAPI app (app.py
  mounts the Gradio UI beside them with `gr.mount_gradio_app`). `get_loop()` is called per request, so
  the engine behind the API may be rebuilt (new config) while the server runs; while there is none
  the API answers 503.

Errors are OpenAI-style `{"error": {...}}` bodies (errors.py lists them). A client that disconnects
(mid-stream or while waiting for a non-streamed answer) has its requests aborted; the engine loop
frees their KV blocks before its next step. The event loop never waits on the engine (job.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Callable

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.runtime.async_engine import EngineLoop
from engine.runtime.gc_utils import freeze_gc_heap
from engine.runtime.process_name import set_process_name
from engine.config import SERVER_ENGINE_DEFAULTS, EngineConfig, add_cli_args

from engine.entrypoints.openai.auth import ApiKeyMiddleware, check_exposure
from engine.entrypoints.openai.connection import HttpLimits, set_ulimit
from engine.entrypoints.openai.errors import CLIENT_CLOSED, error_body, guarded, http_exception_handler
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_engine import STREAM_CHUNK_RATE, OpenAIServing
from engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization, version
from engine.entrypoints.openai.tool_parsers import TOOL_PARSERS
from engine.entrypoints.openai.tracing import RequestTracer

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_REQUEST_TIMEOUT_S = 600.0
MAX_STREAM_INTERVAL_MS = 1000.0
GPU_API_SERVER_COUNT = 4        # --api-server-count on a GPU (docs/serving.md, "One API server process or four")


ARRIVAL_HEADER = b"x-kvscope-arrival-time"


class ApiMiddleware:
    """Stamps arrival and counts API responses by endpoint and status: a request whose client left before
    any response counts as 499 (client closed request), one the connection guard timed out as 408, neither
    as a server error. Every response carries the arrival stamp (`x-kvscope-arrival-time`, time.perf_counter()
    seconds, the clock of every process on this machine), so that a client on the same machine can set its
    send time against it. Pure ASGI (no BaseHTTPMiddleware), so streaming and disconnects pass through
    untouched; paths outside /v1 (e.g. a mounted Gradio UI) are not touched at all."""

    def __init__(self, app, server: OpenAIServing):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] == "/invocations"):
            return await self.app(scope, receive, send)
        # arrival, TTFT counts from here: stamped by ArrivalProtocol when the bytes came in, else now
        state = scope.setdefault("state", {})
        if "kvscope_arrival" not in state:
            state["kvscope_arrival"] = time.perf_counter()
            # Yield once, so every request that reached the event loop with this one is stamped before any
            # of them does its parsing and submission (in a burst the 500th would otherwise be stamped late).
            await asyncio.sleep(0)
        status = None
        client_left = False

        async def receive_():
            nonlocal client_left
            msg = await receive()
            if msg["type"] == "http.disconnect":
                client_left = True
            return msg

        async def send_(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []),
                                          (ARRIVAL_HEADER, b"%.6f" % state["kvscope_arrival"])]}
            await send(msg)

        try:
            await self.app(scope, receive_, send_)
        finally:
            if state.get("kvscope_status"):                 # set by the connection guard (timeouts)
                status = state["kvscope_status"]
            elif status is None:
                status = CLIENT_CLOSED if client_left else 500
            self.server.metrics.count_api(scope["path"], status)


def register(app: FastAPI, get_loop: Callable[[], EngineLoop], api_key: str | None = None, *,
             served_model_name: str | None = None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, retry_after_s: int = 1,
             metrics: ServerMetrics | None = None, tool_call_parser: str | None = None,
             tracer: RequestTracer | None = None, stream_interval: int = 1,
             stream_interval_ms: float | str = 0.0) -> OpenAIServing:
    """Add the API's routes (/v1/*, /health, /metrics) and its /v1 middleware to `app`.

    get_loop: returns the EngineLoop to serve, called per request (raise or return None while there is
    none: the API answers 503). api_key: when set, required on every path of `app` but /health, as
    `Authorization: Bearer <key>` or the cookie of the login page (auth.py).
    request_timeout: seconds per request (None: no limit). max_body_bytes: larger bodies get 413.
    retry_after_s: the Retry-After of 503s. metrics: a ServerMetrics to share (default: a new registry).
    tool_call_parser: how tool calls are read from the output ("hermes", "llama3_json"; None: from the model).
    tracer: exports a span per finished request (OpenTelemetry; tracing.py).
    stream_interval: a stream's chunk waits until it holds this many new tokens (its first token and its
    last chunk leave at once), as vLLM's --stream-interval: fewer, fuller chunks for clients that pay per chunk.
    stream_interval_ms: and waits until this long after the stream's last chunk, so a stream's chunk rate stays
    under 1000 / stream_interval_ms whatever the engine's step rate; "auto": as long as keeps this process's
    chunks under STREAM_CHUNK_RATE a second (its open streams / that rate), counted in whole engine outputs
    (`Job.hold_back`).
    Call before mounting anything at "/" so these routes take precedence."""
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout: must be > 0 seconds or None (got {request_timeout!r})")
    if not (isinstance(max_body_bytes, int) and max_body_bytes >= 1024):
        raise ValueError(f"max_body_bytes: must be an int >= 1024 (got {max_body_bytes!r})")
    if not (isinstance(stream_interval, int) and stream_interval >= 1):
        raise ValueError(f"stream_interval: must be an int >= 1 (got {stream_interval!r})")
    if stream_interval_ms != "auto" and not (isinstance(stream_interval_ms, (int, float))
                                             and 0 <= stream_interval_ms <= MAX_STREAM_INTERVAL_MS):
        raise ValueError(f"stream_interval_ms: must be a number in [0, {MAX_STREAM_INTERVAL_MS}] or 'auto' "
                         f"(got {stream_interval_ms!r})")
    server = OpenAIServing(get_loop, api_key or None, served_model_name, request_timeout, max_body_bytes,
                           retry_after_s, metrics, stream_interval, stream_interval_ms)
    server.tracer = tracer
    serving_completion = OpenAIServingCompletion(server)
    serving_chat = OpenAIServingChat(server, tool_call_parser)
    serving_tokens = OpenAIServingTokenization(server, serving_chat)
    app.state.kvscope_api = server
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(ApiMiddleware, server=server)       # added last: outermost, so it counts the 401s too

    async def health(request: Request):
        ok, why = server.healthy()
        if ok:
            return JSONResponse({"status": "ok", "model": server.model_name_of(server.loop_or_none())})
        return JSONResponse(error_body(why, "server_error", None, 503), 503,
                            headers={"Retry-After": str(retry_after_s)})

    async def metrics_(request: Request):
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request):
        return JSONResponse(server.show_available_models())

    async def completions(request: Request):
        return await serving_completion.create_completion(request)

    async def chat(request: Request):
        return await serving_chat.create_chat_completion(request)

    async def invocations(request: Request):       # SageMaker's route: chat when the body has messages
        body = await server.read_body(request)
        try:
            is_chat = "messages" in json.loads(body)
        except (ValueError, TypeError):
            is_chat = False
        request._body = body                        # read again by the endpoint (starlette caches it here)
        return await (serving_chat.create_chat_completion if is_chat else serving_completion.create_completion)(
            request)

    async def tokenize(request: Request):
        return await serving_tokens.tokenize(request)

    async def detokenize(request: Request):
        return await serving_tokens.detokenize(request)

    async def tokenizer_info(request: Request):
        return serving_tokens.tokenizer_info()

    async def version_(request: Request):
        return JSONResponse({"version": version()})

    app.add_api_route("/health", guarded(health), methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", guarded(metrics_), methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", guarded(models), methods=["GET"])
    app.add_api_route("/v1/completions", guarded(completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", guarded(chat), methods=["POST"])
    app.add_api_route("/invocations", guarded(invocations), methods=["POST"])
    app.add_api_route("/tokenize", guarded(tokenize), methods=["POST"])
    app.add_api_route("/detokenize", guarded(detokenize), methods=["POST"])
    app.add_api_route("/tokenizer_info", guarded(tokenizer_info), methods=["GET"])
    app.add_api_route("/version", guarded(version_), methods=["GET"])
    return server


def build_app(loop: EngineLoop, api_key: str | None = None, **kwargs) -> FastAPI:
    """A FastAPI app serving `loop` (started here if it is not yet); kwargs as in `register`."""
    loop.start()
    app = FastAPI(title="kvscope OpenAI-compatible API", docs_url="/docs", redoc_url=None)
    register(app, lambda: loop, api_key, **kwargs)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    return app


class ServerThread:
    """Serve an ASGI app with uvicorn on a background thread (tests, notebooks, benchmarks).

        with ServerThread(build_app(loop)) as srv:      # port 0: a free port, bound before start
            OpenAI(base_url=srv.url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: HttpLimits | None = None):
        import socket

        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2,
                                                    **(limits or HttpLimits()).uvicorn_kwargs()))
        self._thread = None

    def start(self, timeout: float = 30.0) -> "ServerThread":
        import threading
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name=f"kvscope-api-{self.port}", daemon=True)
        self._thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the API server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------ CLI
def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One `--field-name` flag per EngineConfig field (engine.config.add_cli_args)."""
    add_cli_args(parser, defaults)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_cli_args(args)


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage of a hundred engine flags would bury them), exit code 2."""

    def error(self, message: str):
        cli_error(f"{message} (see --help)", self.prog)


def cli_error(message: str, prog: str | None = None):
    """Print `prog: error: message` and exit with status 2, as argparse does for bad flags."""
    print(f"{prog or 'kvscope'}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def bounded_flag(lo: float, hi: float | None = None, kind: type = int, words: tuple[str, ...] = ()
                 ) -> Callable[[str], float | str]:
    """An argparse type: a number of `kind` (int or float) in [lo, hi] (hi None: at least lo), or one of `words`
    as given; its error names the bound."""
    bound = (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}") + "".join(f", or {w}" for w in words)
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        if text in words:
            return text
        try:
            n = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {bound} (got {text!r})")
        if not lo <= n or (hi is not None and n > hi) or n != n:
            raise argparse.ArgumentTypeError(f"must be {bound} (got {n})")
        return n
    return parse


port_number = bounded_flag(0, 65535)


def bind_socket(host: str, port: int, prog: str | None = None):
    """A listening socket on host:port, bound before the engine loads so a taken port fails at once."""
    import socket
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        cli_error(f"--host {host} --port {port}: cannot listen there: {e.strerror or e}", prog)
    return sock


def add_http_args(g) -> None:
    """Flags shared by the API server and app.py: auth exposure and the connection guard's limits."""
    d = HttpLimits()
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a non-loopback --host without --api-key (refused otherwise)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a connection has to send a request's headers (408 after; 0: no limit)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s,
                   help="seconds allowed between reads of a request body (408 after; 0: no limit)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_s,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--max-connections", type=int, default=None,
                   help="open connections at most (default: the open-file limit less an eighth, at least 256); over "
                        "it the oldest idle connection is closed, or the new one gets 503")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    return HttpLimits(header_timeout_s=args.header_timeout or None, body_timeout_s=args.body_timeout or None,
                      keep_alive_s=args.keep_alive_timeout, max_connections=args.max_connections)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every path but /health")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's)")
    g.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds before a request is aborted with 504 (0: never)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 503")
    g.add_argument("--stream-interval", type=bounded_flag(1), default=1,
                   help="tokens a streamed chunk waits for (the first token and the last chunk leave at once); "
                        "1 sends each engine step's tokens as they come, more sends fewer, fuller chunks")
    g.add_argument("--stream-interval-ms", type=bounded_flag(0, MAX_STREAM_INTERVAL_MS, float, ("auto",)), default=0.0,
                   help="milliseconds a stream's next chunk waits after its last one, its tokens gathered meanwhile "
                        "(with --stream-interval N: N tokens and this long); auto: as long as keeps this API server "
                        f"process under {STREAM_CHUNK_RATE:,.0f} chunks a second, counted in whole engine steps; "
                        "0 (default): no wait")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how tool calls are read from the model's output (default: from its chat template)")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="export a span per request to this OpenTelemetry collector (OTLP; needs the optional "
                        "opentelemetry-sdk and opentelemetry-exporter-otlp packages)")
    g.add_argument("--log-level", default="info")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process (default), so HTTP, JSON and SSE work never shares "
                        "a GIL with the engine; --no-engine-process runs it on a thread of this process")
    g.add_argument("--api-server-count", type=int, default=None,
                   help="API server processes sharing the port in front of the engine processes (launcher.py; "
                        "with --data-parallel-size each attaches to every replica); default: "
                        f"{GPU_API_SERVER_COUNT} for engines on GPUs without tensor parallelism, given "
                        f"{GPU_API_SERVER_COUNT * 2}+ cores (each process streams ~10k chunks/s), else 1")
    add_http_args(g)


def default_api_server_count(config: EngineConfig, engine_process: bool, cpus: int | None, cuda: bool) -> int:
    """--api-server-count's default: several processes where one engine on a GPU streams faster than one API
    process can write (about 100 µs of its CPU per SSE chunk), and the cores are there; else 1. Data-parallel
    replicas on GPUs get the same servers in front of them all (docs/distributed.md measures one and four);
    tensor parallelism keeps one. cuda: whether this machine has a CUDA device."""
    pc = config.parallel_config
    on_gpu = config.model_config.device != "cpu" and cuda
    if on_gpu and engine_process and pc.tensor_parallel_size == 1 and (cpus or 1) >= 2 * GPU_API_SERVER_COUNT:
        return GPU_API_SERVER_COUNT
    return 1


def server_kwargs(args: argparse.Namespace) -> dict:
    """`register`/`build_app` keyword arguments from the flags of `add_server_args`."""
    return dict(api_key=args.api_key, served_model_name=args.served_model_name,
                request_timeout=args.request_timeout or None, max_body_bytes=args.max_body_bytes,
                retry_after_s=args.retry_after, tool_call_parser=args.tool_call_parser,
                stream_interval=args.stream_interval, stream_interval_ms=args.stream_interval_ms,
                tracer=None if args.otlp_traces_endpoint is None else RequestTracer(args.otlp_traces_endpoint))


def app_for_args(loop, args: argparse.Namespace) -> tuple[FastAPI, dict]:
    """The app one API server process serves and its uvicorn settings (the connection guard), from the command
    line's server flags."""
    return build_app(loop, **server_kwargs(args)), http_limits_from_args(args).uvicorn_kwargs()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = CliParser(prog="python -m engine.entrypoints.openai.api_server",
                       description="kvscope's OpenAI-compatible API server")
    add_server_args(parser)
    add_engine_args(parser, defaults=SERVER_ENGINE_DEFAULTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config_from_args(args)
        limits = http_limits_from_args(args)
        warning = check_exposure(args.host, args.api_key, args.allow_unauthenticated)
        build_app_kwargs = server_kwargs(args)
        if build_app_kwargs["max_body_bytes"] < 1024:
            raise ValueError(f"--max-body-bytes: must be >= 1024 (got {args.max_body_bytes})")
    except ValueError as e:
        parser.error(str(e))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if config.parallel_config.tensor_parallel_size > 1:
        from engine.distributed.worker import serve_if_worker
        serve_if_worker()                   # torchrun, ranks > 0: a tensor-parallel worker, never a server
    if args.api_server_count is None:
        args.api_server_count = default_api_server_count(config, args.engine_process, os.cpu_count(),
                                                         torch.cuda.is_available())
    if args.api_server_count != 1:
        if args.api_server_count < 1 or not args.engine_process:
            parser.error(f"--api-server-count: must be >= 1, and > 1 needs the engine process "
                         f"(got {args.api_server_count}{', --no-engine-process' if not args.engine_process else ''})")
        from engine.entrypoints.openai.launcher import serve_many
        set_ulimit()
        raise SystemExit(serve_many(args, config, args.api_server_count, app_for_args))
    if config.parallel_config.data_parallel_size > 1 and not args.engine_process:
        parser.error("--data-parallel-size > 1 runs an engine process per replica: drop --no-engine-process")
    set_ulimit()
    sock = bind_socket(args.host, args.port, parser.prog)
    try:
        if config.parallel_config.data_parallel_size > 1:
            from engine.runtime.dp_client import DPEngineClient
            loop = DPEngineClient(config)
        elif args.engine_process:
            from engine.runtime.core_client import EngineCoreClient
            loop = EngineCoreClient(config)
        else:
            loop = EngineLoop(config)
    except (ValueError, RuntimeError, OSError) as e:
        sock.close()
        cli_error(f"the engine could not start: {e}", parser.prog)
    app = build_app(loop, **build_app_kwargs)
    log.info("serving %s on http://%s:%d (max_waiting_requests=%s)",
             app.state.kvscope_api.model_name_of(loop), args.host, args.port,
             loop.config.scheduler_config.max_waiting_requests)
    freeze_gc_heap()
    set_process_name("kvscope-api0")
    try:
        uvicorn.Server(uvicorn.Config(app, log_level=args.log_level.lower(), timeout_graceful_shutdown=5,
                                      **limits.uvicorn_kwargs())).run(sockets=[sock])
    finally:
        loop.shutdown()


if __name__ == "__main__":
    main()
