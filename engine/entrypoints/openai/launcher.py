"""Several API server processes in front of one engine core (`api_server --api-server-count N`, vLLM's flag).

One Python process turns engine outputs into SSE chunks (JSON encoding, ASGI sends) for every stream; under
hundreds of concurrent streams that process is a bottleneck before the engine is. With N > 1 the launcher binds
the listening socket once, starts the engine core process with one pipe per API server, and starts N API server
processes that share the socket (the kernel hands each new connection to one of them) and each attach an
`EngineCoreClient` to their pipe. The core sends each server its own requests' outputs.

`/metrics` is served by whichever process answers and covers every process's requests: the API servers run
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, a fresh folder per launch, as vLLM does for its
API servers), so each writes its counters and histograms to files that every one of them sums at a scrape; the
engine's gauges (running, waiting, KV usage) are the core's and the same in every process.

If the engine process dies, every API server fails its open requests at once and answers 503 meanwhile, and the
launcher starts a new engine process and hands each server its new pipe (over a control pipe per server), as one
API server restarts its own engine process.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait

from engine.config import EngineConfig
from engine.runtime.gc_utils import freeze_gc_heap
from engine.runtime.process_name import set_process_name

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound listening socket the API server processes share (SO_REUSEPORT as vLLM sets it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _api_server(make_app, args: dict, config: dict, conn, ctrl, sock: socket.socket, index: int) -> None:
    """One API server process: attach to the engine core through `conn`, serve `make_app(client, args)` on the
    shared socket; `ctrl` brings the pipe of each engine process that replaces a dead one."""
    import uvicorn

    from engine.runtime.core_client import EngineCoreClient
    set_process_name(f"kvscope-api{index}")
    ns = argparse.Namespace(**args)
    logging.basicConfig(level=ns.log_level.upper(), format=f"%(asctime)s %(levelname)s api{index} %(name)s: %(message)s")
    # a new engine process's pipe arrives as a file descriptor (SCM_RIGHTS), nothing unpickled
    client = EngineCoreClient(EngineConfig(**config), attach=conn,
                              reattach=lambda: Connection(reduction.recv_handle(ctrl)))
    try:
        app, server_kwargs = make_app(client, ns)
        server = uvicorn.Server(uvicorn.Config(app, log_level=ns.log_level.lower(), **server_kwargs,
                                               timeout_graceful_shutdown=5))
        freeze_gc_heap()
        server.run(sockets=[sock])
    finally:
        client.shutdown()


def serve_many(args: argparse.Namespace, config: EngineConfig, count: int, make_app) -> int:
    """Run the engine core and `count` API server processes until an API server exits (or an interrupt) -> exit
    status; an engine core that dies meanwhile is replaced. make_app(client, args) -> (the ASGI app of one API
    server, its uvicorn.Config keyword arguments); a module-level function: it travels by name."""
    from engine.runtime.core_proc import core_main
    ctx = mp.get_context("spawn")                  # CUDA cannot be forked
    sock = listen_socket(args.host, args.port)
    # read by prometheus_client when the children import it: their metrics go to files in this folder
    metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvscope-metrics-")
    ctrls = [ctx.Pipe(duplex=True) for _ in range(count)]      # (a server's end, the launcher's): new engine pipes

    def start_core() -> tuple[mp.Process, list]:
        """An engine core with a pipe per API server -> (the process, the servers' ends of the pipes)."""
        pipes = [ctx.Pipe(duplex=True) for _ in range(count)]
        proc = ctx.Process(target=core_main, args=(config.to_dict(), [b for _, b in pipes]),
                           name="kvscope-engine-core")
        proc.start()
        for _, b in pipes:                         # the core holds them now
            b.close()
        return proc, [a for a, _ in pipes]

    core, ends = start_core()
    servers = [ctx.Process(target=_api_server, args=(make_app, vars(args), config.to_dict(), ends[i], ctrls[i][0],
                                                     sock, i), name=f"kvscope-api-{i}") for i in range(count)]
    for p in servers:
        p.start()
    for conn in ends + [r for r, _ in ctrls]:      # the servers hold them now
        conn.close()
    sock.close()
    log.info("engine core (pid %s) and %d API server processes on http://%s:%d", core.pid, count, args.host, args.port)
    restarts = 0
    try:
        while True:
            wait([core.sentinel] + [p.sentinel for p in servers])
            time.sleep(0.2)                        # an interrupt reaches every process: let the servers' exits show
            if not all(p.is_alive() for p in servers) or core.exitcode in (0, -2, -15):
                break                              # a server left, or the service is being stopped
            log.error("the engine core (pid %s) exited with %s; starting a new one", core.pid, core.exitcode)
            core, ends = start_core()
            restarts += 1
            for (_, send), conn, server in zip(ctrls, ends, servers):
                reduction.send_handle(send, conn.fileno(), server.pid)    # the server's client attaches to it
                conn.close()
    except KeyboardInterrupt:
        pass
    finally:
        for p in servers:
            if p.is_alive():
                p.terminate()                      # uvicorn shuts down gracefully on SIGTERM
        for p in servers:
            p.join(15)
            if p.is_alive():
                p.kill()
        core.join(30)                              # exits once every API server has left
        if core.is_alive():
            core.kill()
            core.join(5)
        for _, send in ctrls:
            send.close()
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(metrics_dir, ignore_errors=True)
    failed = [p for p in [core] + servers if p.exitcode not in (0, None, -15)]
    for p in failed:
        log.error("%s exited with %s", p.name, p.exitcode)
    log.info("%d engine core restarts", restarts)
    return 1 if failed else 0
