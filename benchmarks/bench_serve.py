"""Serving benchmark over HTTP, `vllm bench serve` style: seeded Poisson (gamma) arrivals of random
token-id prompts sent as streaming /v1/completions to OpenAI-compatible servers; TTFT / TPOT / ITL /
E2EL measured over the wire, plus a kvscope server's own engine-stamped TTFT/E2EL from its /metrics.

    # launch kvscope's server (bundled SmolLM2 on CPU) in a subprocess and benchmark it
    python benchmarks/bench_serve.py --device cpu --num-prompts 32 --request-rate 2
    # or point it at any running OpenAI-compatible server (kvscope, vLLM, ...)
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --request-rate inf --max-concurrency 8
    # side by side, one invocation: the serving suite (512 prompts at once; 400 at 24 req/s) against a
    # running vLLM, a launched kvscope server and kvscope's offline LLM.generate on the same requests
    python benchmarks/bench_serve.py --suite serving --model dummy:llama-3.2-1b --device cuda \
        --target vllm=http://127.0.0.1:8002 --target kvscope=launch --target offline=offline

Targets run one after the other (`--launch NAME='shell command'` starts a server before NAME's runs and
stops it after, so servers never share the GPU). Prints a table per run, then the side-by-side table,
and writes benchmarks/results/serve_<name>.json. For a launched kvscope server it also reads the CPU time each of
its processes spent during the run (psutil): "API server CPU per chunk" is the API process's own (one API server
process), what decides whether it keeps up with the engine in a burst.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.common import free_port, print_table, slug, write_json  # noqa: E402
from benchmarks.serve_procs import (ROOT, launch_server, start_command, start_pyspy,  # noqa: E402
                                    stop_launched, stop_process, wait_ready)
from benchmarks.serve_client import make_runner, make_spec, run_sharded, spec_kwargs  # noqa: E402
from inspector import metrics as M  # noqa: E402
from inspector.http_load import HttpLoadRunner, HttpTarget, format_progress  # noqa: E402
from inspector.load import LengthDist, LoadSpec  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="target server; omitted: launch kvscope's server")
    ap.add_argument("--model", default=None, help="served model id (target) / model to load (launch; "
                                                  "default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cpu", help="launch: engine device")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="launch: extra api_server argument, e.g. --server-arg=--max-num-seqs=32 (repeatable)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--endpoint", default="completions", choices=["completions"])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=2.0, help="requests/s; inf = all at once")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--client-procs", default="1", metavar="N[w][,N[w]...]",
                    help="client processes sharing the workload (each sends every N-th user's requests), so the "
                         "client's own event loop does not delay sends and reads in a burst; 'w' after N: each "
                         "opens its connections before the start, so TCP set-up is not timed; a list runs every "
                         "workload once per value (runs named e.g. burst-c4, burst-c8w)")
    ap.add_argument("--client", default="aiohttp", metavar="aiohttp|openai[,...]",
                    help="the HTTP client: aiohttp (thin, as `vllm bench serve`) or openai (the official AsyncOpenAI, "
                         "whose per-chunk parsing is part of what an application sees); a list runs each (runs of "
                         "the openai client are named e.g. burst-c4-oai)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each workload this many times against each target (every run, repeated or not, "
                         "draws other prompts: seed --seed + its place among the runs, so no prefix-cache hit on "
                         "a run before); runs named e.g. burst-c4-r2. A burst lasts seconds, so one run's "
                         "throughput is noisy")
    ap.add_argument("--prompts", default="random", choices=["random", "text"],
                    help="random token ids, or chat turns of the bundled text set in the model's template")
    ap.add_argument("--num-turns", type=int, default=1, help="> 1: multi-turn chats (history resent each turn)")
    ap.add_argument("--shared-prefix-len", type=int, default=0, help="tokens of a system prompt every chat shares")
    ap.add_argument("--tokenizer-model", default=None,
                    help="text prompts: the model whose tokenizer and template render them (default: --model)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=32000,
                    help="random prompt ids below this (the same prompts on every server)")
    ap.add_argument("--name", default=None, help="result file suffix (default: derived from the run)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    ap.add_argument("--suite", choices=sorted(SUITES), default=None,
                    help="run these workloads (overrides --num-prompts/--request-rate/lengths)")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=URL|launch[:ARGS]|offline|null[:ITL_MS[xTOKENS]]",
                    help="a server to benchmark (repeatable, run in order): a URL, 'launch' (kvscope's server, "
                         "started here; 'launch:--a=1,--b=2' adds server arguments), 'offline' (kvscope's "
                         "LLM.generate on the same requests, in process) or 'null' (no engine: each stream's "
                         "first chunk at once, then one chunk of TOKENS tokens (default 1) every ITL_MS, by default the "
                         "mean chunk gap and tokens per chunk of the target before it on the same workload: the "
                         "client's own TTFT and chunk gaps at that pace, set against every other target's)")
    ap.add_argument("--null-workers", type=int, default=4,
                    help="processes of a null target's server (as kvscope's API server processes on a GPU)")
    ap.add_argument("--pyspy", default=None, metavar="DIR",
                    help="record a launched kvscope server with py-spy during each run (collapsed stacks in DIR)")
    ap.add_argument("--launch", action="append", default=[], metavar="NAME=COMMAND",
                    help="shell command that starts target NAME's server (stopped after its runs)")
    return ap.parse_args(argv)


# Suite workloads: (name, num_prompts, request_rate, input_len, output_len, range_ratio[, extra workload fields])
SUITES = {"serving": [("burst", 512, math.inf, 512, 256, 0.5), ("rate24", 400, 24.0, 512, 256, 0.5)],
          # the same requests for a model ~10x slower per token (70B at TP=2): half the burst, a rate it can sustain
          "serving-large": [("burst", 256, math.inf, 512, 256, 0.5), ("rate4", 200, 4.0, 512, 256, 0.5)],
          # real weights (the bundled SmolLM2): text chat prompts at once, and multi-turn chats behind one shared
          # 512-token system prompt (each turn resends the conversation: prefix-cache heavy); the rate is users/s
          "text": [("text-burst", 256, math.inf, 512, 256, 0.5, {"prompts": "text"}),
                   ("chat-multiturn", 256, 8.0, 128, 128, 0.5,
                    {"prompts": "text", "num_turns": 4, "shared_prefix_len": 512})]}


def scrape(url: str) -> dict:
    try:
        text = httpx.get(url.rstrip("/").removesuffix("/v1") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict = {}
    try:
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
                if "engine" in s.labels:            # a data-parallel replica's series, also kept apart
                    key = f"{s.name}{{engine={s.labels['engine']}}}"
                    out[key] = out.get(key, 0.0) + s.value
    except Exception:  # not Prometheus text (another server)
        return {}
    return out


def server_side(before: dict, after: dict) -> dict:
    """Server-stamped means from the server's histograms over this run (kvscope's metric names, or vLLM's, whose
    stamps are taken inside its engine rather than at the HTTP door)."""
    res = {}
    ns = "kvscope:" if any(k.startswith("kvscope:") for k in after) else "vllm:"
    for key, name in (("ttft_ms", "time_to_first_token_seconds"), ("e2el_ms", "e2e_request_latency_seconds"),
                      ("queue_ms", "request_queue_time_seconds"), ("itl_ms", "inter_token_latency_seconds"),
                      ("tpot_ms", "request_time_per_output_token_seconds")):
        name = ns + name
        n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        s = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
        if n > 0:
            res[key] = 1000 * s / n
    for key in ("kvscope:num_preemptions_total", "kvscope:prefix_cache_hits_total",
                "kvscope:prefix_cache_queries_total"):
        if key in after:
            res[key.split(":")[1]] = after[key] - before.get(key, 0)
    prefix = "kvscope:generation_tokens_total{engine="
    replicas = sorted((k for k in after if k.startswith(prefix)), key=lambda k: int(k[len(prefix):-1]))
    if len(replicas) > 1:                       # how the run's output tokens split over the replicas
        res["replica_output_tokens"] = " / ".join(f"{after[k] - before.get(k, 0):.0f}" for k in replicas)
    return res


# ------------------------------------------------------------------------------------------ report
def print_report(s: dict, wall: float, args, srv: dict) -> None:
    w = 50

    def line(k, v):
        print(f"{k:<40} {v}")

    def head(t):
        print(f"{t:-^{w}}")

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    line("Successful requests:", s["completed"])
    line("Failed requests:", s["failed"] + s.get("not_sent", 0))
    line("Request rate configured (req/s):", "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}")
    line("Max concurrency:", args.max_concurrency or "unlimited")
    line("Benchmark duration (s):", f"{wall:.2f}")
    line("Total input tokens:", s["prompt_tokens"])
    line("Total generated tokens:", s["output_tokens"])
    line("Request throughput (req/s):", f"{s['completed'] / wall:.2f}")
    line("Output token throughput (tok/s):", f"{s['output_tokens'] / wall:.2f}")
    line("Total token throughput (tok/s):", f"{(s['prompt_tokens'] + s['output_tokens']) / wall:.2f}")
    for key, title, label in (("TTFT", "Time to First Token", "TTFT"),
                              ("TPOT", "Time per Output Token (excl. 1st token)", "TPOT"),
                              ("ITL", "Inter-token Latency", "ITL"), ("E2EL", "End-to-end Latency", "E2EL")):
        head(title)
        st = s[key]
        line(f"Mean {label} (ms):", f"{st['mean']:.2f}")
        line(f"Median {label} (ms):", f"{st['p50']:.2f}")
        line(f"P99 {label} (ms):", f"{st['p99']:.2f}")
    if srv:
        head("Server side (engine stamps, /metrics)")
        for k, label in (("ttft_ms", "Mean TTFT (ms):"), ("tpot_ms", "Mean TPOT (ms):"), ("itl_ms", "Mean ITL (ms):"),
                         ("e2el_ms", "Mean E2EL (ms):"), ("queue_ms", "Mean queue time (ms):")):
            if k in srv:
                line(label, f"{srv[k]:.2f}")
        if "num_preemptions_total" in srv:
            line("Preemptions:", int(srv["num_preemptions_total"]))
    print("=" * w)


def workloads(args) -> list[argparse.Namespace]:
    """The runs to make against every target: the suite's, or the one the flags describe, once per
    --client-procs value."""
    try:
        procs = [(int(x.strip().rstrip("w")), x.strip().endswith("w")) for x in str(args.client_procs).split(",")
                 if x.strip()]
    except ValueError:
        procs = []
    if not procs or min(c for c, _ in procs) < 1:
        raise SystemExit(f"--client-procs: expected positive integers, each optionally followed by 'w' "
                         f"(got {args.client_procs!r})")
    clients = [c.strip() for c in str(args.client).split(",") if c.strip()]
    if not clients or set(clients) - {"aiohttp", "openai"}:
        raise SystemExit(f"--client: expected aiohttp and/or openai (got {args.client!r})")
    extra = dict(prompts=args.prompts, num_turns=args.num_turns, shared_prefix_len=args.shared_prefix_len)
    base = [(w[0], *w[1:6], {**extra, **(w[6] if len(w) > 6 else {})}) for w in SUITES[args.suite]] \
        if args.suite else [(args.name, args.num_prompts, args.request_rate, args.input_len, args.output_len,
                              args.range_ratio, extra)]

    if args.repeats < 1:
        raise SystemExit(f"--repeats: expected a positive integer (got {args.repeats})")

    def name(n, c, warm, client, rep):
        n = n if (c, warm) == (1, False) else f"{n or 'run'}-c{c}{'w' if warm else ''}"
        n = n if client == "aiohttp" else f"{n or 'run'}-oai"
        return n if args.repeats == 1 else f"{n or 'run'}-r{rep + 1}"
    # each run draws its own prompts (seed: --seed + its place in the list), so that no run of a target finds
    # the prompts of the run before it in that server's prefix cache
    runs = itertools.product(base, procs, clients, range(args.repeats))
    return [argparse.Namespace(**{**vars(args), **ex, "name": name(n, c, warm, client, rep), "num_prompts": k,
                                  "request_rate": r, "input_len": i, "output_len": o, "range_ratio": rr,
                                  "client_procs": c, "warm_connections": warm, "client": client,
                                  "seed": args.seed + j})
            for j, ((n, k, r, i, o, rr, ex), (c, warm), client, rep) in enumerate(runs)]


def parse_targets(args) -> list[tuple[str, str]]:
    """[(name, URL | 'launch' | 'offline' | 'null[:ITL_MS[xTOKENS]]')]; without --target: --base-url, else a launched
    kvscope server."""
    if not args.target:
        return [("target", args.base_url)] if args.base_url else [("kvscope", "launch")]
    out = []
    for t in args.target:
        name, sep, value = t.partition("=")
        if not sep or not name or not (value in ("launch", "offline", "null")
                                       or value.startswith(("launch:", "null:", "http://", "https://"))):
            raise SystemExit(f"--target: expected NAME=URL|launch|offline|null[:ITL_MS[xTOKENS]] (got {t!r})")
        if value.startswith("null:"):
            null_pace(name, value)
        out.append((name, value))
    return out


def _spec(w) -> LoadSpec:
    return make_spec(**spec_kwargs(w))


def server_cpu(pid: int) -> dict[int, tuple[str, str, float]]:
    """{pid: (its name, its command line, CPU seconds so far)} for the launched server's process and its
    descendants (kvscope names its API server processes kvscope-api<i> and its engine kvscope-core)."""
    out = {}
    try:
        root = psutil.Process(pid)
        for p in [root] + root.children(recursive=True):
            try:
                t = p.cpu_times()
                out[p.pid] = (p.name(), " ".join(p.cmdline()), t.user + t.system)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return out


def null_pace(name: str, value: str) -> tuple[float, int]:
    """null:ITL_MS[xTOKENS] -> (seconds between chunks, tokens per chunk), or a one-line error naming the target."""
    ms, x, tokens = value.partition(":")[2].partition("x")
    try:
        itl_s, per_chunk = float(ms) / 1e3, int(tokens if x else 1)
    except ValueError:
        itl_s = per_chunk = -1
    if not (itl_s >= 0 and per_chunk >= 1):
        raise SystemExit(f"--target {name}: null:ITL_MS[xTOKENS] takes milliseconds >= 0 and, after x, tokens per "
                         f"chunk >= 1 (got {value[5:]!r})")
    return itl_s, per_chunk


def null_cadence(name: str, value: str, results: list[dict], workload: str) -> tuple[float, int]:
    """The null server's (seconds between chunks, tokens per chunk): null:ITL_MS[xTOKENS]'s, else the mean chunk
    gap and the rounded tokens per chunk of the last target run on the same workload (the stream the client parsed
    there; no gap when each of its requests came in one chunk), else (0, 1): every chunk at once."""
    if value.partition(":")[2]:
        return null_pace(name, value)
    for r in reversed(results):
        chunks = r.get("chunks") or {}
        if r["workload"] == workload and not r.get("null") and chunks.get("tokens_per_chunk"):
            itl = ((r.get("summary") or {}).get("ITL") or {}).get("mean")
            return (itl or 0.0) / 1e3, max(1, round(chunks["tokens_per_chunk"]))
    return 0.0, 1


def start_null_server(itl_s: float, tokens_per_chunk: int, workers: int) -> tuple[subprocess.Popen, str]:
    """A server with no engine (openai_client.trivial_app) in `workers` processes: every stream's first chunk at
    once, then one chunk of tokens_per_chunk tokens each itl_s. A client's TTFT against it, less the server's own
    stamp, is what the client itself costs on this workload."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from benchmarks.openai_client import serve_trivial; "
                             f"serve_trivial({port}, None, {tokens_per_chunk}, {itl_s!r}, {workers})"],
                            cwd=str(ROOT), process_group=0)
    url = f"http://127.0.0.1:{port}"
    if wait_ready(proc, lambda: httpx.get(url + "/v1/models", timeout=1).status_code == 200, 30, period=0.1):
        return proc, url
    stop_process(proc)
    raise SystemExit("the null server did not answer in 30 s")


def run_http(w, url: str, model: str | None, profile_pid: int | None = None, profile_out: Path | None = None,
             server_pid: int | None = None) -> dict:
    """One workload against one server: the report, and the result record."""
    target = HttpTarget(url, model=model, api_key=w.api_key)
    # warm-up: one short request, not counted
    warm = HttpLoadRunner(target, LoadSpec(name="warmup", num_requests=1, rate=math.inf,
                                           prompt_len=LengthDist("fixed", 16, 16),
                                           output_len=LengthDist("fixed", 4, 4), seed=w.seed + 999),
                          vocab_size=w.vocab_size)
    warm.start().wait(120)
    if warm.errors:
        raise SystemExit(f"warm-up request failed: {warm.errors}")
    before = scrape(url)
    load_before = os.getloadavg()[0]
    print(f"benchmarking {model or 'the served model'} at {target.v1}: {w.num_prompts} prompts, rate "
          f"{w.request_rate:g} req/s, burstiness {w.burstiness:g}, input {w.input_len}, output {w.output_len}, "
          f"seed {w.seed}, {w.client_procs} {w.client} client process(es), {w.prompts} prompts"
          f"{f', {w.num_turns} turns' if w.num_turns > 1 else ''}"
          f"{', connections opened ahead' if w.warm_connections else ''}", flush=True)
    spy = start_pyspy(profile_pid, profile_out) if profile_pid else None
    cpu_before, t_cpu = (server_cpu(server_pid) if server_pid else {}), time.perf_counter()
    tok_model = w.tokenizer_model or w.model
    if w.client_procs > 1 or w.warm_connections:
        res = run_sharded(url, model, w.api_key, dict(spec_kwargs(w), client_procs=w.client_procs), w.vocab_size,
                          w.client_procs, w.timeout, w.warm_connections, w.client, tok_model)
        t0 = res["t_start"]
        ends = [r.metrics.finished_time for r in res["records"] if r.metrics.finished_time is not None]
        wall = (max(ends) if ends else res["t_end"]) - t0
        records, errors, model_name = res["records"], res["errors"], res["model"]
        s = M.summarize(records)
        s.update(num_requests=w.num_prompts, failed=res["failed"], not_sent=res["not_sent"],
                 http_status=res["http_status"])
    else:
        runner = make_runner(url, model, w.api_key, _spec(w), w.vocab_size, w.client, tok_model)
        t0 = time.perf_counter()
        runner.start()
        while not runner.wait(5.0):
            print("  " + format_progress(runner.progress()), flush=True)
            if time.perf_counter() - t0 > w.timeout:
                runner.stop()
                runner.wait(30)
                break
        wall = time.perf_counter() - t0
        records, errors, model_name, s = runner.records, runner.errors, runner.model, runner.summary()
    if spy is not None:
        spy.send_signal(2)
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
    cpu_after, t_cpu = (server_cpu(server_pid) if server_pid else {}), time.perf_counter() - t_cpu
    load_after = os.getloadavg()[0]
    srv = server_side(before, scrape(url))
    print_report(s, wall, w, srv)
    print(f"machine load average (1 min): {load_before:.2f} before, {load_after:.2f} after, "
          f"{os.cpu_count()} cores (other processes share these cores)")
    if errors:
        print(f"{len(errors)} errors, e.g. {errors[:3]}")
    rows = [dict(request_id=r.request_id, prompt_len=r.prompt_len, output_len=r.output_len,
                 ttft_ms=None if r.metrics.ttft is None else 1000 * r.metrics.ttft,
                 e2el_ms=None if r.metrics.e2e is None else 1000 * r.metrics.e2e,
                 send_to_arrival_ms=None if r.server_arrival is None
                 else 1000 * (r.server_arrival - r.metrics.arrival_time),
                 num_chunks=len(r.metrics.token_times)) for r in records]
    sends = sorted(x["send_to_arrival_ms"] for x in rows if x["send_to_arrival_ms"] is not None)
    send_to_arrival = {"n": len(sends), "mean_ms": sum(sends) / len(sends), "p50_ms": _pct(sends, 50),
                       "p99_ms": _pct(sends, 99)} if sends else None
    if send_to_arrival:
        print(f"client send -> server arrival (x-kvscope-arrival-time), {len(sends)} requests: mean "
              f"{send_to_arrival['mean_ms']:.2f} ms, p99 {send_to_arrival['p99_ms']:.2f} ms", flush=True)
    gaps, chunks = chunk_gaps(records, t0)
    itl_tail = {"over_10ms": sum(g > 10 for g, _, _ in gaps), "over_15ms": sum(g > 15 for g, _, _ in gaps),
                "n": len(gaps), "largest": [dict(ms=round(g, 2), at_s=round(t, 3), request=rid)
                                            for g, t, rid in gaps[-15:]]}
    chunks["tokens_per_chunk"] = s["output_tokens"] / chunks["n"] if chunks["n"] else None
    procs = [dict(pid=pid, name=name, cmd=cmd[-160:], cpu_s=round(cpu - cpu_before[pid][2], 3),
                  busy=round((cpu - cpu_before[pid][2]) / t_cpu, 3))
             for pid, (name, cmd, cpu) in cpu_after.items() if pid in cpu_before]
    api = [p for p in procs if p["name"].startswith("kvscope-api")]
    if api and chunks["n"]:                        # every API server process's CPU, per chunk streamed
        chunks["api_cpu_us_per_chunk"] = 1e6 * sum(p["cpu_s"] for p in api) / chunks["n"]
    return {"target": target.v1, "model": model_name, "duration_s": wall, "itl_tail": itl_tail, "chunks": chunks,
            "send_to_arrival": send_to_arrival,
            "client": w.client,
            "client_procs": w.client_procs, "warm_connections": w.warm_connections,
            "output_tok_s": s["output_tokens"] / wall, "completed": s["completed"],
            "load_average_1min": {"before": load_before, "after": load_after},
            "summary": {k: v for k, v in s.items() if k != "slo"}, "server_side": srv,
            "http_status": s.get("http_status"), "errors": errors[:20], "server_processes": procs,
            "requests": rows}


def chunk_gaps(records, t0: float) -> tuple[list[tuple[float, float, str]], dict]:
    """Every gap between a request's consecutive chunks as (ms, its start in s after t0, request id), sorted, and
    the chunk figures: count, gap p50 / p99, and the p99 of the gaps that start once every stream has had its first
    chunk (a burst's admission left out: the client still sending requests, the server prefilling them)."""
    gaps = sorted(((b - a) * 1e3, a - t0, r.request_id) for r in records
                  for a, b in zip(r.metrics.token_times, r.metrics.token_times[1:]))
    firsts = [r.metrics.token_times[0] for r in records if r.metrics.token_times]
    all_started = max(firsts) - t0 if firsts else float("inf")
    started = [g for g, t, _ in gaps if t >= all_started]
    return gaps, {"n": sum(len(r.metrics.token_times) for r in records),
                  "gap_p50_ms": _pct([g for g, _, _ in gaps], 50), "gap_p99_ms": _pct([g for g, _, _ in gaps], 99),
                  "gap_p99_all_started_ms": _pct(started, 99), "gaps_all_started": len(started)}


def _pct(sorted_vals: list[float], q: float) -> float | None:
    if not sorted_vals:
        return None
    return sorted_vals[min(len(sorted_vals) - 1, int(round(q / 100 * (len(sorted_vals) - 1))))]


def run_offline(w, args) -> dict:
    """kvscope's LLM.generate on the same requests (the workload's arrival times are ignored: all at once)."""
    from engine import LLM, SamplingParams
    from inspector.load import build_workload
    cfg = {a.split("=", 1)[0].lstrip("-").replace("-", "_"): a.split("=", 1)[1] if "=" in a else "true"
           for a in args.server_arg if a.startswith("--") and not a.startswith("--no-")}
    llm = LLM(args.model, device=args.device, **{k: _num(v) for k, v in cfg.items()})
    prefix, items = build_workload(_spec(w), w.vocab_size, (), llm.engine.tokenizer if w.prompts == "text" else None)
    prompts = [prefix + it.new_tokens for it in items]
    params = [SamplingParams(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True) for it in items]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)          # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for o in outs)
    print(f"offline LLM.generate: {len(outs)} requests, {n_out} output tokens in {wall:.2f} s = "
          f"{n_out / wall:.0f} tok/s", flush=True)
    llm.engine.close()
    return {"target": "LLM.generate", "model": args.model, "duration_s": wall, "output_tok_s": n_out / wall,
            "completed": len(outs), "summary": {"output_tokens": n_out, "prompt_tokens": sum(map(len, prompts))}}


def _num(v: str):
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(v.lower(), v)


def client_own_ttft(r: dict) -> float | None:
    """A null-server run's mean TTFT at the client less the server's own stamp: the client's cost."""
    srv = (r.get("server_side") or {}).get("ttft_ms")
    ttft = (r.get("summary") or {}).get("TTFT")
    return None if srv is None or not ttft else ttft["mean"] - srv


def metrics_vs_client(r: dict, less_ms: float | None) -> float | None:
    """100 * (/metrics mean TTFT - (client mean TTFT - less_ms)) / that: how far the server's own figure is from what
    the client saw of the server, once less_ms (the client's own cost, or its requests' mean send -> arrival) is
    taken off the client's."""
    srv = (r.get("server_side") or {}).get("ttft_ms")
    ttft = (r.get("summary") or {}).get("TTFT")
    if srv is None or not ttft or less_ms is None or ttft["mean"] - less_ms <= 0:
        return None
    seen = ttft["mean"] - less_ms
    return 100 * (srv - seen) / seen


def side_by_side(results: list[dict]) -> list[dict]:
    """One row per metric, one column per (target, workload)."""
    cols = [f"{r['name']}/{r['workload']}" for r in results]
    rows = [{"metric": "output tok/s", **{c: r["output_tok_s"] for c, r in zip(cols, results)}}]
    for key in ("TTFT", "TPOT", "ITL", "E2EL"):
        for stat in ("mean", "p50", "p99"):
            rows.append({"metric": f"{key} {stat} (ms)",
                         **{c: (r["summary"].get(key) or {}).get(stat) for c, r in zip(cols, results)}})
    rows.append({"metric": "server mean TTFT (ms, /metrics)",
                 **{c: (r.get("server_side") or {}).get("ttft_ms") for c, r in zip(cols, results)}})
    # the client's send -> first chunk against the server's arrival -> first chunk handed to the transport (one
    # perf_counter clock on one machine): the rest is the client (its send, its reading) and the transport
    rows.append({"metric": "client - server mean TTFT (ms)",
                 **{c: (r["summary"]["TTFT"]["mean"] - r["server_side"]["ttft_ms"])
                    if (r.get("server_side") or {}).get("ttft_ms") is not None and r.get("summary", {}).get("TTFT")
                    else None for c, r in zip(cols, results)}})
    # per request, the client's send stamp against the server's arrival stamp (its response header): the part of
    # that gap spent before the server had the request (the client building and sending it, the server accepting it)
    if any(r.get("send_to_arrival") for r in results):
        rows.append({"metric": "client send -> server arrival mean / p99 (ms)",
                     **{c: (f"{r['send_to_arrival']['mean_ms']:.1f} / {r['send_to_arrival']['p99_ms']:.1f}"
                            if r.get("send_to_arrival") else None) for c, r in zip(cols, results)}})
        rows.append({"metric": "/metrics TTFT vs client's from arrival (%)",
                     **{c: None if r.get("null") else metrics_vs_client(r, (r.get("send_to_arrival") or {})
                                                                          .get("mean_ms"))
                        for c, r in zip(cols, results)}})
    # a null target (no engine) on the same workload and client measures the client's own part of that gap (the
    # last null target's, if several); what is left of the client's TTFT is the server's, which /metrics should tell
    own = {r["workload"]: client_own_ttft(r) for r in results if r.get("null")}
    if own:
        rows.append({"metric": "client's own TTFT (null server, ms)",
                     **{c: client_own_ttft(r) if r.get("null") else own.get(r["workload"])
                        for c, r in zip(cols, results)}})
        rows.append({"metric": "/metrics TTFT vs client's less its own (%)",
                     **{c: metrics_vs_client(r, own.get(r["workload"])) if not r.get("null") else None
                        for c, r in zip(cols, results)}})
    if any((r.get("server_side") or {}).get("replica_output_tokens") for r in results):
        rows.append({"metric": "output tokens per replica",
                     **{c: (r.get("server_side") or {}).get("replica_output_tokens") for c, r in zip(cols, results)}})
    for key, label in (("tokens_per_chunk", "tokens per chunk"), ("gap_p50_ms", "chunk gap p50 (ms)"),
                       ("gap_p99_ms", "chunk gap p99 (ms)"),
                       ("gap_p99_all_started_ms", "chunk gap p99 once every stream started (ms)"),
                       ("api_cpu_us_per_chunk", "API server CPU per chunk (µs)")):
        rows.append({"metric": label, **{c: (r.get("chunks") or {}).get(key) for c, r in zip(cols, results)}})
    return rows


def repeat_medians(results: list[dict]) -> list[dict]:
    """Per (target, workload) run more than once (--repeats): the median of the headline figures, and the
    spread of the throughput."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["name"], re.sub(r"-r\d+$", "", r["workload"])), []).append(r)

    def med(rs, get):
        vals = [v for v in map(get, rs) if v is not None]
        return statistics.median(vals) if vals else None
    rows = []
    for (name, wl), rs in groups.items():
        if len(rs) < 2:
            continue
        tok = [r["output_tok_s"] for r in rs]
        rows.append({"target": f"{name}/{wl}", "runs": len(rs), "output tok/s": statistics.median(tok),
                     "min": min(tok), "max": max(tok),
                     "TTFT mean (ms)": med(rs, lambda r: (r["summary"].get("TTFT") or {}).get("mean")),
                     "TTFT p99 (ms)": med(rs, lambda r: (r["summary"].get("TTFT") or {}).get("p99")),
                     "chunk gap p99 (ms)": med(rs, lambda r: (r.get("chunks") or {}).get("gap_p99_ms"))})
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    runs = workloads(args)
    launches = dict(x.split("=", 1) for x in args.launch)
    results, failed = [], {}
    for name, value in parse_targets(args):
        proc = None
        try:
            if value.startswith("launch"):
                extra = [a for a in value.partition(":")[2].split(",") if a]
                largs = argparse.Namespace(**{**vars(args), "num_prompts": max(w.num_prompts for w in runs),
                                              "server_arg": args.server_arg + extra})
                proc, url, _ = launch_server(largs)
            elif value.startswith("null"):
                url = None                                  # one null server per workload, at its cadence
            elif value != "offline":
                url = value
                if name in launches:
                    proc = start_command(name, launches[name], url)
            for w in runs:
                print(f"==== {name} · {w.name or 'run'} ====", flush=True)
                if value.startswith("null"):
                    stop_process(proc)
                    itl_s, per_chunk = null_cadence(name, value, results, w.name or "run")
                    proc, url = start_null_server(itl_s, per_chunk, args.null_workers)
                    print(f"null server ({args.null_workers} processes): first chunk at once, then one of "
                          f"{per_chunk} token(s) every {1e3 * itl_s:.2f} ms", flush=True)
                if value == "offline":
                    if not math.isinf(w.request_rate) or any(r["name"] == name for r in results):
                        continue                  # offline has no arrival process or client: one burst run
                    r = run_offline(w, args)
                else:
                    prof = dict(profile_pid=proc.pid, profile_out=Path(args.pyspy) / f"{slug(name)}_{w.name or 'run'}.txt") \
                        if args.pyspy and value.startswith("launch") else {}
                    r = run_http(w, url, args.model if value.startswith(("http://", "https://")) and not args.target
                                 else None,
                                 server_pid=proc.pid if value.startswith("launch") else None, **prof)
                results.append({"name": name, "workload": w.name or "run", **r,
                                **({"null": True, "null_itl_ms": 1e3 * itl_s, "null_tokens_per_chunk": per_chunk}
                                   if value.startswith("null") else {})})
        except (Exception, SystemExit) as e:      # one target failing keeps the others' results
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"target {name} failed: {failed[name]}", flush=True)
        finally:
            stop_launched(proc) if value.startswith("launch") else stop_process(proc)
    if not results:
        raise SystemExit(f"every target failed: {failed}")
    print(f"{' side by side ':=^50}")
    rows = side_by_side(results)
    print_table(rows, ["metric"] + [f"{r['name']}/{r['workload']}" for r in results])
    medians = repeat_medians(results)
    if medians:
        print(f"{' median of the repeats ':=^50}")
        print_table(medians, list(medians[0]))
    cpu = "cpu"
    try:
        cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1).strip()
    except Exception:  # noqa: BLE001
        pass
    name = args.name or slug(f"{args.suite or ''}-{'-'.join(n for n, _ in parse_targets(args))}-"
                             f"{args.device}-r{args.request_rate:g}-n{args.num_prompts}")
    path = write_json(f"serve_{name}", {
        "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
        "client_host": f"{platform.node()} / {cpu} / {os.cpu_count()} cores", "side_by_side": rows,
        "repeat_medians": medians,
        "results": results, "failed": failed})
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
