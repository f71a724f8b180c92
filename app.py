"""kvscope app: a Gradio playground and live inspector over the engine, in one process.

    python app.py [--host 127.0.0.1] [--port 7860] [--model PATH|dummy:NAME] [--device auto|cpu|cuda]
                  [--data-parallel-size N] [--set FIELD=VALUE ...] [--api-only] [--api-key KEY] [--request-timeout S]
                  [--allow-unauthenticated] [--header-timeout S] [--body-timeout S] [--max-connections N]

Structure (one-way flow):
  webui/host.py  EngineHost owns the EngineLoop (engine on its own thread; data-parallel: a DPEngineLoop, a thread
                 per replica), the inspector Recorder subscribed to their events, the current load run and compare
                 job, and ONE producer thread that turns the latest snapshot into serialised Plotly figures about
                 once a second.
  webui/ui.py    Gradio Blocks, one module per tab; timer handlers only read the producer's latest snapshot
                 (cheap, no per-tab queueing, concurrency_limit=None); request handlers call the engine's public API.
  create_app     a FastAPI app with the Gradio UI mounted at "/"; the serving API (another module) registers its
                 routes on the same app first (`--api-only` serves just those).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gradio as gr  # noqa: E402

from engine.config import SERVER_ENGINE_DEFAULTS, EngineConfig  # noqa: E402
from engine.runtime.llm_engine import resolve_device  # noqa: E402
from engine.entrypoints.openai.api_server import (CliParser, add_http_args, bind_socket, cli_error,  # noqa: E402
                                                  http_limits_from_args, port_number)
from engine.entrypoints.openai.auth import check_exposure  # noqa: E402
from engine.entrypoints.openai.connection import HttpLimits, set_ulimit  # noqa: E402
from engine.runtime.gc_utils import freeze_gc_heap  # noqa: E402
from webui.host import EngineHost  # noqa: E402
from webui.ui import CSS, build_ui  # noqa: E402

__all__ = ["ServerHandle", "add_serving_api", "api_options_from_args", "config_from_args", "create_app", "main",
           "parse_args", "serve_in_thread"]

log = logging.getLogger("kvscope.app")
ROOT = Path(__file__).resolve().parent


def add_serving_api(app, host: EngineHost) -> bool:
    """Let the serving API (engine/entrypoints/openai/api_server.py) register its routes on `app`.
    Its module may define `register(app, get_loop)`; returns True when routes were added."""
    try:
        from engine.entrypoints.openai import api_server  # type: ignore
    except Exception:
        return False
    reg = getattr(api_server, "register", None)
    if reg is None:
        return False
    reg(app, lambda: host.require_loop(), **host.api_options)
    return True


def create_app(host: EngineHost, api_only: bool = False, with_api: bool = True):
    """A FastAPI app: serving API routes first (if available), then the Gradio UI mounted at '/'."""
    from fastapi import FastAPI
    app = FastAPI(title="kvscope")
    has_api = add_serving_api(app, host) if (with_api or api_only) else False
    if api_only:
        if not has_api:
            raise SystemExit("--api-only: the serving API module is not available in this build")
        return app, None

    @app.get("/healthz")
    def healthz():
        return {"state": host.state, "engine": host.describe()}

    demo = build_ui(host)
    app = gr.mount_gradio_app(app, demo, path="/", css=CSS, theme=gr.themes.Soft(), footer_links=[],
                              show_error=True, run_history=False)
    return app, demo


class ServerHandle:
    """A uvicorn server on a background thread (tests, notebooks): `.url`, `.stop()`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}/"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=1, **HttpLimits().uvicorn_kwargs()))
        self.thread = threading.Thread(target=self.server.run, name="kvscope-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerHandle":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_thread(host: EngineHost, port: int = 0, bind: str = "127.0.0.1") -> ServerHandle:
    """Build the app around a started EngineHost and serve it on a background thread."""
    app, _ = create_app(host)
    srv = ServerHandle(app, bind, port).start()
    host.self_url = srv.url.rstrip("/")
    return srv


def parse_args(argv=None):
    ap = CliParser(prog="python app.py", description="kvscope: an LLM inference engine you can see into")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=port_number, default=7860)
    ap.add_argument("--model", default=None, help="HF folder, dummy:<preset>, or empty for the bundled SmolLM2")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks sharing the model (NCCL over consecutive GPUs from --device, gloo on CPU)")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine replicas in this process, each on its own GPU from --device (all on the CPU), "
                         "requests routed by load and cached prefix; the inspector shows each replica")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any EngineConfig field, e.g. --set num_kv_blocks=256 (repeatable)")
    ap.add_argument("--api-only", action="store_true", help="serve only the HTTP serving API (no UI)")
    ap.add_argument("--api-key", default=None,
                    help="require the key on every path but /health: 'Authorization: Bearer <key>' for the API, "
                         "the login page for the UI (401 otherwise)")
    ap.add_argument("--served-model-name", default=None, help="the model id API clients send (default: the model's)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="API: seconds before a request is aborted with 504 (0: never)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="API: larger request bodies get 413")
    ap.add_argument("--log-level", default="info")
    add_http_args(ap)
    return ap.parse_args(argv)


def config_from_args(args) -> EngineConfig:
    # the app schedules by priority, so a person's Playground turn (priority -1) gets ahead of simulated
    # users (0), and streams multi-step blocks of about 4 ms as the API server does; --set restores the
    # engine's defaults (scheduling_policy=fcfs, multi_step_max_ms=none)
    kw: dict[str, Any] = {"model": args.model or None, "device": args.device, "scheduling_policy": "priority",
                          "tensor_parallel_size": args.tensor_parallel_size,
                          "data_parallel_size": args.data_parallel_size,
                          "multi_step_max_ms": SERVER_ENGINE_DEFAULTS["multi_step_max_ms"]}
    # on a CPU the app runs int4 weights (in the GGUF's groups of 32, the CPU default): twice fp32's decode rate,
    # and on the bundled SmolLM2 fp32's greedy tokens (docs/quantization.md); --set quantization=none gives fp32
    if args.tensor_parallel_size == 1 and args.device in ("auto", "cpu") and resolve_device(args.device).type == "cpu":
        kw.update(quantization="int4")
    sets: dict[str, str] = {}
    for item in args.set:
        if "=" not in item:
            cli_error(f"--set {item!r}: expected FIELD=VALUE", "python app.py")
        k, v = item.split("=", 1)
        sets[k.strip()] = v
    unknown = sorted(set(sets) - set(EngineConfig.field_names()))
    if unknown:
        cli_error(f"--set: unknown EngineConfig field(s) {unknown}; fields: {', '.join(EngineConfig.field_names())}",
                  "python app.py")
    try:
        return EngineConfig.from_strings(sets, **kw)
    except ValueError as e:
        cli_error(f"--set: {e}", "python app.py")


def api_options_from_args(args) -> dict:
    """register() keyword arguments of the serving API from app.py's flags."""
    if args.request_timeout < 0:
        cli_error(f"--request-timeout: must be >= 0 seconds (got {args.request_timeout})", "python app.py")
    if args.max_body_bytes < 1024:
        cli_error(f"--max-body-bytes: must be >= 1024 (got {args.max_body_bytes})", "python app.py")
    return dict(api_key=args.api_key or None, served_model_name=args.served_model_name,
                request_timeout=args.request_timeout or None, max_body_bytes=args.max_body_bytes)


def main(argv=None) -> None:
    import uvicorn
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    api_options = api_options_from_args(args)
    try:
        limits = http_limits_from_args(args)
        warning = check_exposure(args.host, args.api_key, args.allow_unauthenticated)
    except ValueError as e:
        cli_error(str(e), "python app.py")
    if warning:
        print(warning, flush=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)     # the HTTP load target: no line per request
    set_ulimit()
    sock = bind_socket(args.host, args.port, "python app.py")
    port = sock.getsockname()[1]
    host = EngineHost(cfg)
    host.api_options = api_options
    host.self_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::', '') else args.host}:{port}"
    log.info("loading the engine (%s)…", cfg.model_config.model or "bundled SmolLM2-135M-Instruct")
    try:
        host.start(inspect=not args.api_only)
    except Exception as e:  # noqa: BLE001 - a model that is not there, a device that is not there, ...
        sock.close()
        host.shutdown()
        cli_error(f"the engine could not start: {host.error or e}", "python app.py")
    app, _ = create_app(host, api_only=args.api_only)
    print(f"kvscope ready on http://{args.host}:{port}  ({host.describe()})", flush=True)
    freeze_gc_heap()
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2,
                                      **limits.uvicorn_kwargs())).run(sockets=[sock])
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
