"""Several API server processes in front of the engine cores (`api_server --api-server-count N`, vLLM's flag).

One Python process turns engine outputs into SSE chunks (JSON encoding, ASGI sends) for every stream; under
hundreds of concurrent streams that process is a bottleneck before the engine is. With N > 1 the launcher binds
the listening socket once, starts the engine core process with one pipe per API server, and starts N API server
processes that share the socket (the kernel hands each new connection to one of them) and each attach an
`EngineCoreClient` to their pipe. The core sends each server its own requests' outputs.

`/metrics` is served by whichever process answers and covers every process's requests: the API servers run
prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR`, a fresh folder per launch, as vLLM does for its
API servers), so each writes its counters and histograms to files that every one of them sums at a scrape; the
engine's gauges (running, waiting, KV usage) are the core's and the same in every process.

With `--data-parallel-size M` the launcher starts an engine core per replica, and every API server attaches to
all of them and routes its own requests (`dp_client.DPEngineClient`: prefix affinity and least-loaded, on the
loads that server sees; the kernel's spreading of connections evens out what the servers do not share).

If an engine process dies, every API server fails its open requests on it at once and answers 503 meanwhile, and
the launcher starts a new engine process and hands each server its new pipe (over a control pipe per server and
replica), as one API server restarts its own engine process.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import signal
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


def _engine_core(config: dict, conns: list, launcher: int) -> None:
    """A replica's engine core under the launcher: core_proc.core_main, ending with the launcher if it is killed."""
    from engine.runtime.core_proc import core_main, watch_parent
    watch_parent(launcher)
    core_main(config, conns)


def _api_server(make_app, args: dict, config: dict, replicas: list[dict], conns: list, ctrls: list,
                sock: socket.socket, index: int, launcher: int) -> None:
    """One API server process: attach to each engine core (replica r's config `replicas[r]`) through `conns`,
    serve `make_app(client, args)` on the shared socket; `ctrls[r]` brings the pipe of each engine process that
    replaces replica r's. It ends with the launcher if the launcher is killed."""
    import uvicorn

    from engine.runtime.core_client import EngineCoreClient
    from engine.runtime.core_proc import watch_parent
    from engine.runtime.dp_client import DPEngineClient
    watch_parent(launcher)
    set_process_name(f"kvscope-api{index}")
    ns = argparse.Namespace(**args)
    logging.basicConfig(level=ns.log_level.upper(), format=f"%(asctime)s %(levelname)s api{index} %(name)s: %(message)s")
    # a new engine process's pipe arrives as a file descriptor (SCM_RIGHTS), nothing unpickled
    clients = [EngineCoreClient(EngineConfig(**cfg), attach=conn,
                                reattach=lambda ctrl=ctrl: Connection(reduction.recv_handle(ctrl)))
               for cfg, conn, ctrl in zip(replicas, conns, ctrls)]
    client = clients[0] if len(clients) == 1 else DPEngineClient(EngineConfig(**config), replicas=clients)
    try:
        app, server_kwargs = make_app(client, ns)
        server = uvicorn.Server(uvicorn.Config(app, log_level=ns.log_level.lower(), **server_kwargs,
                                               timeout_graceful_shutdown=5))
        freeze_gc_heap()
        server.run(sockets=[sock])
    finally:
        client.shutdown()


def serve_many(args: argparse.Namespace, config: EngineConfig, count: int, make_app) -> int:
    """Run an engine core per data-parallel replica and `count` API server processes until an API server exits (or
    an interrupt) -> exit status; an engine core that dies meanwhile is replaced. Every API server attaches to every
    core and routes its own requests over them (dp_client.PrefixRouter, on the loads it sees). make_app(client,
    args) -> (the ASGI app of one API server, its uvicorn.Config keyword arguments); a module-level function: it
    travels by name."""
    from engine.runtime.dp_client import replica_configs
    ctx = mp.get_context("spawn")                  # CUDA cannot be forked
    configs = replica_configs(config)
    sock = listen_socket(args.host, args.port)
    # read by prometheus_client when the children import it: their metrics go to files in this folder
    metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvscope-metrics-")
    # per server, per replica: (the server's end, the launcher's), for the pipes of new engine processes
    ctrls = [[ctx.Pipe(duplex=True) for _ in configs] for _ in range(count)]

    def start_core(r: int) -> tuple[mp.Process, list]:
        """Replica r's engine core with a pipe per API server -> (the process, the servers' ends of the pipes)."""
        pipes = [ctx.Pipe(duplex=True) for _ in range(count)]
        proc = ctx.Process(target=_engine_core, args=(configs[r].to_dict(), [b for _, b in pipes], os.getpid()),
                           name=f"kvscope-engine-core-{r}")
        proc.start()
        for _, b in pipes:                         # the core holds them now
            b.close()
        return proc, [a for a, _ in pipes]

    started = [start_core(r) for r in range(len(configs))]
    cores = [proc for proc, _ in started]
    servers = [ctx.Process(target=_api_server, args=(make_app, vars(args), config.to_dict(),
                                                     [c.to_dict() for c in configs], [ends[i] for _, ends in started],
                                                     [ctrls[i][r][0] for r in range(len(configs))], sock, i,
                                                     os.getpid()),
                           name=f"kvscope-api-{i}") for i in range(count)]
    for p in servers:
        p.start()
    for conn in [c for _, ends in started for c in ends] + [a for row in ctrls for a, _ in row]:
        conn.close()                               # the servers hold them now
    sock.close()
    log.info("%d engine core(s) (pids %s) and %d API server processes on http://%s:%d", len(cores),
             [c.pid for c in cores], count, args.host, args.port)
    restarts = 0

    def stop(signum, frame):
        raise KeyboardInterrupt                    # SIGTERM (a service manager, `kill`) stops as Ctrl-C does
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            wait([c.sentinel for c in cores] + [p.sentinel for p in servers])
            time.sleep(0.2)                        # an interrupt reaches every process: let the servers' exits show
            if not all(p.is_alive() for p in servers) or any(c.exitcode in (0, -2, -15) for c in cores):
                break                              # a server left, or the service is being stopped
            for r, core in enumerate(cores):
                if core.is_alive():
                    continue
                log.error("engine core %d (pid %s) exited with %s; starting a new one", r, core.pid, core.exitcode)
                cores[r], ends = start_core(r)
                restarts += 1
                for row, conn, server in zip(ctrls, ends, servers):
                    reduction.send_handle(row[r][1], conn.fileno(), server.pid)   # the server's client attaches
                    conn.close()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        for p in servers:
            if p.is_alive():
                p.terminate()                      # uvicorn shuts down gracefully on SIGTERM
        for p in servers:
            p.join(15)
            if p.is_alive():
                p.kill()
        for core in cores:
            core.join(30)                          # exits once every API server has left
            if core.is_alive():
                core.kill()
                core.join(5)
        for row in ctrls:
            for _, send in row:
                send.close()
        del os.environ["PROMETHEUS_MULTIPROC_DIR"]
        shutil.rmtree(metrics_dir, ignore_errors=True)
    failed = [p for p in cores + servers if p.exitcode not in (0, None, -15)]
    for p in failed:
        log.error("%s exited with %s", p.name, p.exitcode)
    log.info("%d engine core restarts", restarts)
    return 1 if failed else 0
