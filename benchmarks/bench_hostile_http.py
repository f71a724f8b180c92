"""Hostile HTTP clients against kvscope's API server: oversized prompts and stalled connections.

    python benchmarks/bench_hostile_http.py                       # 4 MiB prompts, 20,000 stalled sockets
    python benchmarks/bench_hostile_http.py --idle 5000 --big-mib 1 --target app

Starts the server itself (`python -m engine.entrypoints.openai.api_server --model dummy:tiny`, or `python
app.py` with --target app) with a body limit large enough that the prompts reach the prompt checks, then:

1. baseline: small completions, one fresh connection each (latency p50 / max);
2. oversized prompts: one --big-mib MiB prompt to /v1/completions and one to /v1/chat/completions, then
   --burst of them at once; for each the status, the latency (request sent -> response read, raw sockets so
   client-side JSON work is not counted) and the server's RSS (before, peak while it ran, after);
3. stalled connections: --idle sockets opened from two helper processes (each raises its own open-file
   limit), a third each silent, half a request line, or headers plus part of a body; while they are open,
   small completions on fresh connections (all must succeed, latency p50 / max); the server's open file
   descriptors; after --settle s how many stalled sockets the server answered or closed; and the server log's
   tracebacks, "Too many open files" lines and connection-limit warnings.
Prints a table and writes results/bench_hostile_http.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, print_table, write_json  # noqa: E402
from benchmarks.serve_procs import wait_ready  # noqa: E402

SMALL = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}).encode()


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def post(path: str, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), len(body))) + body


def exchange(port: int, data: bytes, timeout: float = 60.0) -> tuple[int, float, bytes]:
    """Send one request on a fresh connection; (status, seconds until the whole response was read, body)."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    status = int(head.split(b" ")[1]) if head else 0
    return status, time.perf_counter() - t0, body


class RssSampler:
    """The server's resident memory, sampled every 5 ms while active."""

    def __init__(self, pid: int):
        self.pid = pid

    def rss_mib(self) -> float:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def __enter__(self):
        self.before = self.rss_mib()
        self.peak = self.before
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss_mib())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        time.sleep(0.5)                      # let freed buffers go back
        self.after = self.rss_mib()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ------------------------------------------------------------------------------ stalled-socket helpers
STALLS = [b"", b"POST /v1/completions HTT",
          b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"ab"]


def staller(port: int, n: int, conn) -> None:
    """Open `n` stalled sockets, report how many opened, hold them until told, then report how many the server
    answered or closed."""
    raise_nofile()
    socks, failed = [], 0
    for i in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if STALLS[i % 3]:
                s.sendall(STALLS[i % 3])
            socks.append(s)
        except OSError:
            failed += 1
    conn.send((len(socks), failed))
    conn.recv()                              # "check"
    answered = 0
    for s in socks:
        s.setblocking(False)
        try:
            s.recv(4096)                     # b"" (closed) or the server's 408: answered either way
            answered += 1
        except BlockingIOError:
            pass
        except OSError:
            answered += 1
    conn.send(answered)
    conn.recv()                              # "close"
    for s in socks:
        s.close()


def good_requests(port: int, n: int, gap: float = 0.1) -> dict:
    lat, ok = [], 0
    for _ in range(n):
        try:
            st, dt, body = exchange(port, post("/v1/completions", SMALL), timeout=30)
            ok += st == 200 and json.loads(body)["usage"]["completion_tokens"] == 4
            lat.append(dt)
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(gap)
    return {"ok": ok, "n": n, "p50_ms": 1e3 * statistics.median(lat) if lat else None,
            "max_ms": 1e3 * max(lat) if lat else None}


# ------------------------------------------------------------------------------ the run
def start_server(args) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    common = ["--port", str(port), "--max-body-bytes", str(64 << 20), "--header-timeout", str(args.header_timeout),
              "--body-timeout", str(args.header_timeout)]
    common += shlex.split(args.server_args)
    if args.target == "app":
        cmd = [sys.executable, str(ROOT / "app.py"), "--model", "dummy:tiny", "--device", "cpu", *common]
        probe = "/healthz"
    else:
        cmd = [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--model", "dummy:tiny", "--device",
               "cpu", "--log-level", "warning", *common]
        probe = "/health"
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvscope_hostile_{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=raise_nofile)
    if not wait_ready(proc, lambda: httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=2).status_code == 200, 300):
        proc.kill()
        raise SystemExit(f"the server did not come up; see {log}")
    return proc, port, log


def oversized(port: int, pid: int, mib: float, burst: int) -> list[dict]:
    text = ("hello world " * (int(mib * (1 << 20)) // 12 + 1))[:int(mib * (1 << 20))]
    cases = [("completion", "/v1/completions", {"prompt": text, "max_tokens": 2}),
             ("chat", "/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": text}], "max_tokens": 2})]
    rows = []
    for name, path, body in cases:
        data = post(path, json.dumps(body).encode())
        for k in (1, burst):
            with RssSampler(pid) as rss, ThreadPoolExecutor(k) as ex:
                res = list(ex.map(lambda _: exchange(port, data), range(k)))
            rows.append({"case": f"{name} {mib:g} MiB x{k}", "status": sorted({r[0] for r in res}),
                         "max_ms": round(1e3 * max(r[1] for r in res), 1),
                         "rss_before_mib": round(rss.before, 1), "rss_peak_growth_mib": round(rss.peak - rss.before, 1),
                         "rss_after_growth_mib": round(rss.after - rss.before, 1)})
    return rows


def stalled(port: int, pid: int, n: int, settle: float, log: Path) -> dict:
    parts = [n // 2, n - n // 2]
    pipes, procs = [], []
    ctx = mp.get_context("fork")
    t0 = time.perf_counter()
    for k in parts:
        a, b = ctx.Pipe()
        p = ctx.Process(target=staller, args=(port, k, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    opened = failed = 0
    during = {"ok": 0, "n": 0}
    fds_peak = 0
    with ThreadPoolExecutor(1) as ex:
        fut = None
        for a in pipes:
            while not a.poll(0.2):
                fds_peak = max(fds_peak, open_fds(pid))
                if fut is None:              # good requests while the sockets are still being opened, too
                    fut = ex.submit(good_requests, port, 10)
            o, f = a.recv()
            opened, failed = opened + o, failed + f
        open_s = time.perf_counter() - t0
        fds_peak = max(fds_peak, open_fds(pid))
        early = fut.result() if fut is not None else None
        during = good_requests(port, 20)
    fds_held = open_fds(pid)
    time.sleep(settle)
    for a in pipes:
        a.send("check")
    answered = sum(a.recv() for a in pipes)
    fds_after = open_fds(pid)
    for a in pipes:
        a.send("close")
    for p in procs:
        p.join(30)
    text = log.read_text(errors="replace")
    return {"stalled_opened": opened, "stalled_failed": failed, "open_s": round(open_s, 1),
            "good_while_opening": early, "good_while_held": during, "server_fds_peak": fds_peak,
            "server_fds_held": fds_held, "server_fds_after_settle": fds_after,
            "stalled_answered_or_closed_after_settle": answered,
            "log_tracebacks": text.count("Traceback"), "log_emfile": text.count("Too many open files"),
            "log_limit_warnings": text.count("connection limit reached")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["api", "app"], default="api")
    ap.add_argument("--idle", type=int, default=20000, help="stalled sockets to open (capped by the fd limit)")
    ap.add_argument("--big-mib", type=float, default=4.0)
    ap.add_argument("--server-args", default="", help="more server flags, e.g. '--api-server-count 2'")
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--header-timeout", type=float, default=10.0, help="the server's header and body timeouts")
    ap.add_argument("--settle", type=float, default=12.0, help="seconds to hold the stalled sockets before checking")
    args = ap.parse_args()
    hard = raise_nofile()
    n_idle = min(args.idle, 2 * (hard - 64))
    proc, port, log = start_server(args)
    try:
        base = good_requests(port, 10)
        big = oversized(port, proc.pid, args.big_mib, args.burst)
        stall = stalled(port, proc.pid, n_idle, args.settle, log)
        after = good_requests(port, 10)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"\nserver: {args.target}, dummy:tiny, open-file limit {hard}\n")
    print_table(big, ["case", "status", "max_ms", "rss_before_mib", "rss_peak_growth_mib", "rss_after_growth_mib"])
    rows = [{"phase": "baseline", **base}, {"phase": "while opening stalled", **(stall["good_while_opening"] or {})},
            {"phase": f"with {stall['stalled_opened']} stalled open", **stall["good_while_held"]},
            {"phase": "after", **after}]
    print()
    print_table(rows, ["phase", "ok", "n", "p50_ms", "max_ms"])
    print()
    for k in ("stalled_opened", "stalled_failed", "open_s", "server_fds_peak", "server_fds_held",
              "server_fds_after_settle", "stalled_answered_or_closed_after_settle", "log_tracebacks", "log_emfile",
              "log_limit_warnings"):
        print(f"  {k:42s} {stall[k]}")
    path = write_json("bench_hostile_http", {"target": args.target, "fd_limit": hard, "args": vars(args),
                                             "oversized": big, "good_requests": rows, "stalled": stall})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
