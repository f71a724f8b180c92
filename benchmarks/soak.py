"""Soak test: N simulated users over HTTP for a fixed time against `app.py` (Gradio UI + OpenAI API in one
process, as users run it), mixing good and bad traffic, while a sampler records the server's health.

    python benchmarks/soak.py --duration 1200 --users 16                  # starts `python app.py` itself
    python benchmarks/soak.py --url http://127.0.0.1:7860 --pid 1234 ...  # against a running app
    python benchmarks/soak.py --server api --kill-core-at 60 ...          # the API server; its engine process
                                                                          # is killed 60 s in

    python benchmarks/soak.py --server api --load-frac 0.7 --users 512 ...  # open loop at 70% of the capacity
                                                                          # a closed-loop probe measures

The load is closed loop (--users, each sending one request at a time with up to --think-s between them) or
open loop (--rate: requests arrive as a Poisson process however many are in flight; --load-frac F first
measures the capacity, --users users with no pause for --probe-s seconds, and sends F x its requests/s).
Each request is one action drawn by weight (ACTIONS):
  stream      streaming /v1/completions, token-id prompt, greedy, ignore_eos: must finish "length" with
              exactly max_tokens tokens (usage) and as many streamed tokens (logprobs)
  chat        non-streamed /v1/chat/completions with ignore_eos: exactly max_tokens completion tokens
  disconnect  a streaming request the client closes after a few tokens
  cancel      a non-streamed request the client abandons after a random fraction of a second
  bad         an invalid request (negative max_tokens, temperature < 0, top_p > 1, no prompt, broken JSON,
              unknown model): must get a 4xx
  too_long    a prompt longer than max_model_len: must get a 4xx
  ui          GET / (the Gradio page): must get 200

Every --sample-s the sampler reads `/metrics` (running / waiting requests, KV blocks in use = pool - 1
reserved - free list, API responses by status) and the server's RSS (process + children), and writes a CSV
row. At the end the script waits for the server to go idle and judges:
  - every good request (stream, chat) completed with the right length; every ui page 200
  - every bad / too-long request got a 4xx; the server answered no 5xx at all
  - 0 KV blocks in use once idle
  - memory flat after warm-up: a least-squares fit of RSS over the samples after the first
    --warmup-frac of the run rises by at most --rss-tol-mib over that window
With --kill-core-at S (--server api, whose engine runs in its own process) the engine core process is
SIGKILLed S seconds in; the server restarts it. Then good requests may fail, but only with a clear error
(503 or a stream error event with code engine_stopped / engine_unavailable), only around the restart, and
good requests sent after it must be served again.
It writes soak.csv, soak.json (counts, verdicts) and soak.html (Plotly), plus soak.png when kaleido or
playwright + /usr/bin/chromium can render it; exit status 1 when a criterion fails.
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import importlib.util
import json
import multiprocessing
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, write_png  # noqa: E402
from benchmarks.serve_procs import wait_ready  # noqa: E402
from benchmarks.soak_health import annotate, parse_metrics, percentile, sampler, slope_per_s, wait_idle  # noqa: E402
from benchmarks.soak_users import ACTIONS, BAD, GOOD, Soak, users_process  # noqa: E402



async def run(base: str, pid: int | None, args) -> dict:
    async with httpx.AsyncClient(base_url=base, timeout=30.0) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        mml = parse_metrics((await c.get("/metrics")).text)["max_model_len"]
    capacity = None
    if args.load_frac:
        capacity = await probe_capacity(base, model, mml, args)
        args.rate = round(args.load_frac * capacity["requests_per_s"], 2)
        print(f"capacity: {capacity['requests_per_s']} requests/s ({capacity['good_tokens_per_s']} good tokens/s) "
              f"with {args.users} users and no pause; the soak sends {args.rate} requests/s")
    before = await wait_idle(base, args.idle_timeout)      # the counters the run's own responses are told from
    t0 = time.monotonic()
    soak = Soak(base, model, mml, args, t0)
    rows: list[dict] = []
    stop = asyncio.Event()
    samp = asyncio.create_task(sampler(base, pid, t0, rows, args.sample_s, stop))
    kill = asyncio.create_task(kill_core(base, pid, t0, args.kill_core_at, soak)) if args.kill_core_at else None
    await load(soak)
    t_users = time.monotonic() - t0
    kill_res = await kill if kill is not None else None
    final = await wait_idle(base, args.idle_timeout)
    stop.set()
    await samp
    annotate(rows, soak.tally)
    res = judge(soak, rows, final, t_users, args, kill_res, before)
    res["capacity"] = capacity
    if capacity:
        res["checks"]["capacity probe: no failed request (a 503 while full is admission at work)"] = \
            capacity["failed"] == 0
        res["passed"] = all(res["checks"].values())
        res["load_frac_tokens"] = round(res["good_tokens_per_s_after_warmup"] / capacity["good_tokens_per_s"], 3)
    return res


async def load(soak: Soak) -> None:
    """soak's load until its deadline: in this process, or spread over --procs client processes."""
    procs = soak.args.procs
    if procs == 1:
        await soak.drive()
        return
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = [loop.run_in_executor(pool, users_process, soak.base, soak.model, soak.mml, soak.args, soak.t0, i)
                 for i in range(procs)]
        for tally in await asyncio.gather(*parts):
            soak.tally.merge(tally)


async def probe_capacity(base: str, model: str, mml: int, args) -> dict:
    """The server's capacity for this request mix: --users users in a closed loop with no pause for --probe-s
    seconds; requests finished per second (and good tokens per second) over the probe's last two thirds."""
    probe_args = argparse.Namespace(**{**vars(args), "think_s": 0.0, "duration": args.probe_s, "rate": None})
    t0 = time.monotonic()
    soak = Soak(base, model, mml, probe_args, t0)
    await load(soak)
    lo, hi = args.probe_s / 3, args.probe_s
    done = [r for r in soak.tally.records if lo <= r[1] < hi]
    return dict(users=args.users, probe_s=args.probe_s, requests=len(soak.tally.records),
                requests_per_s=round(len(done) / (hi - lo), 2),
                good_tokens_per_s=round(sum(r[5] for r in done) / (hi - lo), 1),
                refused_full=sum(r[3] == "full" for r in soak.tally.records),
                failed=sum(r[3] == "fail" for r in soak.tally.records), failures=soak.tally.failures[:10])


def core_process(pid: int):
    """The engine core process of the API server `pid` (`python -m engine.runtime.core_main`, or a multiprocessing
    child that is not the resource tracker), or None."""
    import psutil
    for child in psutil.Process(pid).children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:                 # gone, or a killed core not reaped yet
            continue
        if "engine.runtime.core_main" in cmd or ("spawn_main" in cmd and "resource_tracker" not in cmd):
            return child
    return None


async def kill_core(base: str, pid: int | None, t0: float, at_s: float, soak: Soak) -> dict:
    """SIGKILL the engine core process `at_s` seconds into the run; wait until /health is ok again; the users
    keep going for at least --after-restart-s more."""
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
    core = core_process(pid) if pid else None
    if core is None:
        return {"error": "no engine core process found (--server api, with the engine in its own process)"}
    core.kill()
    t_kill = time.monotonic() - t0
    soak.deadline = float("inf")             # the users keep going until it is back
    async with httpx.AsyncClient(base_url=base, timeout=5.0) as c:
        while True:                          # back: a new core process, and /health says so
            await asyncio.sleep(0.1)
            new = core_process(pid)
            if new is None or new.pid == core.pid:
                continue
            try:
                if (await c.get("/health")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
    t_back = time.monotonic() - t0
    soak.deadline = max(t0 + soak.args.duration, time.monotonic() + soak.args.after_restart_s)
    return {"killed_pid": core.pid, "t_kill_s": round(t_kill, 2), "t_restored_s": round(t_back, 2),
            "new_pid": new.pid if new is not None else None}


def judge(soak: Soak, rows: list[dict], final: dict, t_users: float, args, kill: dict | None = None,
          before: dict | None = None) -> dict:
    ta = soak.tally
    # the server's 5xx / 503 answers during this run (not the capacity probe's, nor an earlier user's)
    during = {k: (final.get(k) or 0) - ((before or {}).get(k) or 0) for k in ("http_5xx", "http_503")}
    warm_t = args.warmup_frac * t_users
    post = [r for r in rows if r["t_s"] >= warm_t and r["t_s"] <= t_users and r["rss_mib"] == r["rss_mib"]]
    slope = slope_per_s([r["t_s"] for r in post], [r["rss_mib"] for r in post])
    window = (post[-1]["t_s"] - post[0]["t_s"]) if len(post) > 1 else 0.0
    growth = slope * window
    # p99 TTFT of the streams sent in the quarter after warm-up against those sent in the run's last quarter
    def ttft_p99(lo: float, hi: float) -> float | None:
        v = percentile([r[4] for r in ta.records if r[2] == "stream" and r[4] is not None and lo <= r[0] < hi], 99)
        return None if v is None else round(v * 1e3, 1)
    quarter = (t_users - warm_t) / 3
    ttft_early, ttft_late = ttft_p99(warm_t, warm_t + quarter), ttft_p99(t_users - quarter, t_users)
    post_ttft = [r[4] for r in ta.records if r[2] == "stream" and r[4] is not None and r[0] >= warm_t]
    sent, ok = ta.sent, ta.ok
    checks = {
        "good requests complete with the right length": all(sent[a] == ok[a] for a in GOOD) and
        sum(ok[a] for a in GOOD) > 0,
        "bad requests get a 4xx": all(sent[a] == ok[a] for a in BAD) and sum(sent[a] for a in BAD) > 0,
        "UI page served": sent["ui"] == ok["ui"],
        "no 5xx from the server": not during["http_5xx"],
        "0 KV blocks in use at the end": final.get("kv_blocks_in_use") == 0,
        f"RSS flat after warm-up (fit rises <= {args.rss_tol_mib:g} MiB)": len(post) >= 3 and
        growth <= args.rss_tol_mib,
        f"p99 TTFT stable (last part <= {args.ttft_drift:g}x the part after warm-up)":
        ttft_early is not None and ttft_late is not None and ttft_late <= args.ttft_drift * ttft_early,
    }
    if kill is not None:
        # good requests may fail around the restart, with a clear error only; afterwards they are served
        engine_errs = ta.engine_errors
        lo, hi = kill.get("t_kill_s", 0) - 1.0, kill.get("t_restored_s", 0) + 5.0
        del checks["no 5xx from the server"]
        checks["good requests complete with the right length"] = all(
            sent[a] == ok[a] + sum(e[1] == a for e in engine_errs) for a in GOOD)
        checks["bad requests get a 4xx"] = all(
            sent[a] == ok[a] + sum(e[1] == a for e in engine_errs) for a in BAD)
        checks["engine core killed and restarted (new pid)"] = bool(kill.get("new_pid")) and \
            kill.get("new_pid") != kill.get("killed_pid")
        checks["failed requests got a clear engine error, around the restart only"] = \
            all(lo <= e[0] <= hi for e in engine_errs)
        checks["no 5xx but the 503s of the restart"] = during["http_5xx"] == during["http_503"]
        # RSS is no signal across a restart (a process went, a new one grew): not judged
        checks = {k: v for k, v in checks.items() if not k.startswith(("RSS flat", "p99 TTFT stable"))}
        checks["good requests served after the restart"] = \
            sum(r[0] > kill.get("t_restored_s", float("inf")) for r in ta.records if r[2] in GOOD and r[3] == "ok") > 0
    elif ta.engine_errors:
        ta.failures.extend(ta.engine_errors[:10])
        checks["good requests complete with the right length"] = False
    return dict(users=None if args.rate else args.users, rate_per_s=args.rate, duration_s=args.duration, users_done_s=round(t_users, 1), server=args.server,
                kill_core=kill, num_engine_errors=len(ta.engine_errors), engine_errors=ta.engine_errors[:50],
                sent=sent, ok=ok, requests=len(ta.records), http_5xx_during=during["http_5xx"],
                final={k: final.get(k) for k in ("kv_blocks_in_use", "num_kv_blocks", "num_requests_running",
                                                 "num_requests_waiting", "http_2xx", "http_4xx", "http_5xx", "http_503",
                                                 "num_preemptions_total")},
                rss_mib_first=rows[0]["rss_mib"] if rows else None, rss_mib_last=rows[-1]["rss_mib"] if rows else None,
                rss_mib_peak=max((r["rss_mib"] for r in rows), default=None),
                rss_warmup_s=round(warm_t, 1), rss_slope_mib_per_min=round(slope * 60, 3),
                rss_fit_growth_mib=round(growth, 1), rss_tol_mib=args.rss_tol_mib,
                ttft_ms_after_warmup={"p50": _ms(percentile(post_ttft, 50)), "p99": _ms(percentile(post_ttft, 99)),
                                      "max": _ms(max(post_ttft, default=None))},
                ttft_p99_ms_early=ttft_early, ttft_p99_ms_late=ttft_late, procs=args.procs,
                good_per_s_after_warmup=round(sum(r[2] in GOOD and r[3] == "ok" and r[0] >= warm_t
                                                  for r in ta.records) / max(t_users - warm_t, 1e-9), 2),
                good_tokens_per_s_after_warmup=round(sum(r[5] for r in ta.records if r[0] >= warm_t)
                                                     / max(t_users - warm_t, 1e-9), 1),
                running_mean_after_warmup=_mean([r["running"] for r in post if r.get("running") is not None]),
                checks=checks, passed=all(checks.values()), failures=ta.failures, rows=rows)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 1)


def _mean(xs: list) -> float | None:
    return round(sum(xs) / len(xs), 1) if xs else None


# ----------------------------------------------------------------------------- report
def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def figure(rows: list[dict], res: dict, title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    t = [r["t_s"] / 60 for r in rows]
    fig = make_subplots(rows=3, cols=2, vertical_spacing=0.11, horizontal_spacing=0.09,
                        subplot_titles=("Server RSS (MiB)", "KV blocks in use",
                                        "Requests running / waiting", "Cumulative outcomes",
                                        f"Stream TTFT per {args_period(rows)} window (ms)",
                                        "Good requests finished per second"))
    fig.add_trace(go.Scatter(x=t, y=[r["rss_mib"] for r in rows], name="RSS", line_color="#4E79A7"), 1, 1)
    fig.add_vline(x=res["rss_warmup_s"] / 60, line_dash="dot", line_color="#888", row=1, col=1)
    fig.add_trace(go.Scatter(x=t, y=[r["kv_blocks_in_use"] for r in rows], name="blocks in use",
                             line_color="#F28E2B"), 1, 2)
    fig.add_trace(go.Scatter(x=t, y=[r["running"] for r in rows], name="running", line_color="#59A14F"), 2, 1)
    fig.add_trace(go.Scatter(x=t, y=[r["waiting"] for r in rows], name="waiting", line_color="#E15759"), 2, 1)
    base_5xx = rows[0]["server_5xx"] or 0                 # the server's count before this run (a capacity probe's)
    for key, name, color in (("good_ok", "good, right length", "#59A14F"), ("bad_4xx", "bad → 4xx", "#B07AA1"),
                             ("client_failures", "failures", "#FF9DA7"), ("server_5xx", "server 5xx", "#000")):
        ys = [r[key] - base_5xx if key == "server_5xx" else r[key] for r in rows]
        fig.add_trace(go.Scatter(x=t, y=ys, name=name, line_color=color), 2, 2)
    for key, name, color in (("ttft_p50_ms", "TTFT p50", "#76B7B2"), ("ttft_p99_ms", "TTFT p99", "#E15759")):
        fig.add_trace(go.Scatter(x=t, y=[r.get(key) for r in rows], name=name, line_color=color), 3, 1)
    fig.add_vline(x=res["rss_warmup_s"] / 60, line_dash="dot", line_color="#888", row=3, col=1)
    fig.add_trace(go.Scatter(x=t, y=[r.get("good_per_s") for r in rows], name="good / s", line_color="#59A14F",
                             showlegend=False), 3, 2)
    fig.update_xaxes(title_text="minutes", row=3)
    fig.update_layout(title=dict(text=title, x=0.01, font_size=15), height=900, width=1100,
                      margin=dict(l=60, r=20, t=80, b=50), template="plotly_white",
                      legend=dict(orientation="h", y=-0.12, x=0))
    return fig


def args_period(rows: list[dict]) -> str:
    return f"{rows[1]['t_s'] - rows[0]['t_s']:.0f} s" if len(rows) > 1 else "sample"


# ----------------------------------------------------------------------------- server
def start_app(args) -> tuple[subprocess.Popen, str]:
    port = args.port or free_port()
    if args.server == "api":       # the engine in its own process; --set FIELD=VALUE -> --field VALUE
        cmd = [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--port", str(port),
               "--log-level", "warning"]
        for s in args.set:
            k, _, v = s.partition("=")
            cmd += [f"--{k.strip().replace('_', '-')}", v]
    else:
        cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--log-level", "warning"]
        for s in args.set:
            cmd += ["--set", s]
    if args.model:
        cmd += ["--model", args.model]
    log = open(Path(args.out) / "soak_server.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    if wait_ready(proc, lambda: httpx.get(base + "/health", timeout=2).status_code == 200, args.start_timeout):
        return proc, base
    if proc.poll() is not None:
        raise SystemExit(f"app.py exited with {proc.returncode}; see {log.name}")
    proc.kill()
    raise SystemExit(f"app.py did not answer /health within {args.start_timeout} s")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1200.0, help="seconds the users keep sending")
    ap.add_argument("--users", type=int, default=16, help="closed-loop users (and the capacity probe's)")
    ap.add_argument("--rate", type=float, default=None,
                    help="open loop instead of users: requests arrive as a Poisson process of this many a second")
    ap.add_argument("--load-frac", type=float, default=None, metavar="F",
                    help="open loop at F x the capacity a --probe-s closed-loop run of --users users measures")
    ap.add_argument("--probe-s", type=float, default=60.0, help="length of the --load-frac capacity probe")
    ap.add_argument("--url", default=None, help="a running app's base URL (default: start app.py)")
    ap.add_argument("--server", choices=["app", "api"], default="app",
                    help="what to start: app.py (UI + API, engine on a thread) or the API server (engine in its "
                         "own process)")
    ap.add_argument("--kill-core-at", type=float, default=None, metavar="S",
                    help="SIGKILL the engine core process S seconds in (--server api); it must come back")
    ap.add_argument("--after-restart-s", type=float, default=15.0,
                    help="with --kill-core-at: the users keep going at least this long after the engine is back")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's pid, for RSS")
    ap.add_argument("--model", default=None, help="app.py --model (default: the bundled SmolLM2)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="app.py --set")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(8, 96), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(4, 48), metavar=("MIN", "MAX"))
    ap.add_argument("--think-s", type=float, default=0.5, help="max pause between a user's requests")
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-frac", type=float, default=0.25, help="RSS fit starts after this part of the run")
    ap.add_argument("--rss-tol-mib", type=float, default=32.0,
                    help="most the fitted RSS may rise between the end of warm-up and the end")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="wait this long for the server to go idle")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak"))
    ap.add_argument("--png", default=None, help="also write the plot here (e.g. assets/soak.png)")
    ap.add_argument("--no-png", action="store_true", help="HTML report only")
    ap.add_argument("--procs", type=int, default=1,
                    help="client processes the users are spread over (a GPU server outruns one Python client)")
    ap.add_argument("--ttft-drift", type=float, default=1.5,
                    help="most the streams' p99 TTFT in the run's last quarter may exceed that just after warm-up")
    ap.add_argument("--replot", default=None, metavar="DIR", help="only draw DIR's soak.csv + soak.json")
    args = ap.parse_args(argv)
    if args.procs > 1 and args.kill_core_at is not None:
        ap.error("--kill-core-at needs the users in one process (--procs 1)")
    if args.load_frac is not None and (args.rate is not None or not 0 < args.load_frac <= 1 or args.probe_s <= 0):
        ap.error("--load-frac F: 0 < F <= 1, a --probe-s above 0, and no --rate")
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be above 0")
    return args


def run_soak(args) -> dict:
    """Start app.py (unless --url), run the users and the sampler, stop the app; the judged result."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        proc, base = start_app(args)
        pid = proc.pid
    try:
        return asyncio.run(run(base, pid, args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), args)
    return report(run_soak(args), Path(args.out), args)


def plot(rows: list[dict], res: dict, out: Path, args) -> str | None:
    """soak.html (and soak.png, --png) from the rows; nothing where Plotly is not installed (replot later with
    --replot OUT) -> the PNG written, or None."""
    if importlib.util.find_spec("plotly") is None:
        print("no plotly here: soak.csv and soak.json only (python benchmarks/soak.py --replot DIR draws them)")
        return None
    load = f"{res['rate_per_s']} requests/s" if res.get("rate_per_s") else f"{res['users']} users"
    title = (f"kvscope soak: {load} × {res['duration_s'] / 60:.3g} min, {res['requests']} requests — "
             f"{'PASS' if res['passed'] else 'FAIL'}")
    fig = figure(rows, res, title)
    fig.write_html(str(out / "soak.html"), include_plotlyjs="cdn")
    written = None
    pngs = [] if args.no_png else [out / "soak.png"] + ([Path(args.png)] if args.png else [])
    for png in pngs:
        png.parent.mkdir(parents=True, exist_ok=True)
        if write_png(fig, png):
            written = str(png)
    return written


def replot(out: Path, args) -> int:
    """Draw a finished run's soak.csv + soak.json (a run on a machine without Plotly)."""
    res = json.loads((out / "soak.json").read_text())
    with open(out / "soak.csv", newline="") as f:
        rows = [{k: (float(v) if v not in ("", "None") else None) for k, v in r.items()} for r in csv.DictReader(f)]
    res["png"] = plot(rows, res, out, args)
    (out / "soak.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out}/soak.html" + (f", {res['png']}" if res["png"] else ""))
    return 0


def report(res: dict, out: Path, args) -> int:
    rows = res.pop("rows")
    write_csv(rows, out / "soak.csv")
    res["png"] = plot(rows, res, out, args)
    (out / "soak.json").write_text(json.dumps(res, indent=1))
    print(f"{'action':<11}{'sent':>7}{'ok':>7}")
    for a in ACTIONS:
        print(f"{a:<11}{res['sent'][a]:>7}{res['ok'][a]:>7}")
    print(f"RSS first/peak/last {res['rss_mib_first']}/{res['rss_mib_peak']}/{res['rss_mib_last']} MiB; "
          f"after {res['rss_warmup_s']} s warm-up slope {res['rss_slope_mib_per_min']} MiB/min "
          f"(fit +{res['rss_fit_growth_mib']} MiB, tolerance {res['rss_tol_mib']} MiB)")
    print(f"final: {res['final']}")
    print(f"after warm-up: {res['good_per_s_after_warmup']} good requests/s "
          f"({res['good_tokens_per_s_after_warmup']} tokens/s), {res['running_mean_after_warmup']} "
          f"running on average; stream TTFT {res['ttft_ms_after_warmup']} ms; p99 {res['ttft_p99_ms_early']} ms "
          f"just after warm-up, {res['ttft_p99_ms_late']} ms at the end")
    if res.get("capacity"):
        c = res["capacity"]
        print(f"capacity probe: {c['requests_per_s']} requests/s, {c['good_tokens_per_s']} good tokens/s "
              f"({c['users']} users, no pause, {c['probe_s']:g} s; {c['refused_full']} refused with 503 while full, "
              f"{c['failed']} failed); the soak ran at {res['rate_per_s']} requests/s, "
              f"{res['load_frac_tokens']:.0%} of the probe's good tokens/s")
    if res.get("kill_core"):
        k = res["kill_core"]
        print(f"engine core killed at {k.get('t_kill_s')} s (pid {k.get('killed_pid')}), serving again at "
              f"{k.get('t_restored_s')} s (pid {k.get('new_pid')}); {res['num_engine_errors']} requests got "
              "a clear engine error")
        for e in res["engine_errors"][:3]:
            print("  engine error:", e)
    for name, ok in res["checks"].items():
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")
    for f in res["failures"][:10]:
        print("  failure:", f)
    print(f"wrote {out}/soak.csv, soak.json, soak.html" + (f", {res['png']}" if res["png"] else ""))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
