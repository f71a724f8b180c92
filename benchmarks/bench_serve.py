"""Serving benchmark over HTTP, `vllm bench serve` style: seeded Poisson (gamma) arrivals of random
token-id prompts sent as streaming /v1/completions to an OpenAI-compatible server; TTFT / TPOT / ITL /
E2EL measured over the wire, plus the server's own engine-stamped TTFT/E2EL from its /metrics.

    # launch kvscope's server (bundled SmolLM2 on CPU) in a subprocess and benchmark it
    python benchmarks/bench_serve.py --device cpu --num-prompts 32 --request-rate 2
    # or point it at any running OpenAI-compatible server (kvscope, vLLM, ...)
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --request-rate inf --max-concurrency 8

Prints the table and writes benchmarks/results/serve_<name>.json.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.common import RESULTS, slug, write_json  # noqa: E402
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
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)]; 0 = fixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=None, help="result file suffix (default: derived from the run)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------ server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(args) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--device", args.device, "--log-level", "warning",
           "--max-waiting-requests", str(max(256, args.num_prompts))]
    if args.model:
        cmd += ["--model", args.model]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += args.server_arg
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvscope_bench_serve_{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    print(f"launching: {' '.join(cmd)}  (log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, cwd=str(Path(__file__).resolve().parents[1]), env=env,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}:\n{log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in 300 s; see {log_path}")


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
    except Exception:  # not Prometheus text (another server)
        return {}
    return out


def server_side(before: dict, after: dict) -> dict:
    """Engine-stamped means from the server's histograms over this run (kvscope servers)."""
    res = {}
    for key, name in (("ttft_ms", "kvscope:time_to_first_token_seconds"),
                      ("e2el_ms", "kvscope:e2e_request_latency_seconds"),
                      ("queue_ms", "kvscope:request_queue_time_seconds"),
                      ("itl_ms", "kvscope:inter_token_latency_seconds"),
                      ("tpot_ms", "kvscope:request_time_per_output_token_seconds")):
        n = after.get(name + "_count", 0) - before.get(name + "_count", 0)
        s = after.get(name + "_sum", 0) - before.get(name + "_sum", 0)
        if n > 0:
            res[key] = 1000 * s / n
    for key in ("kvscope:num_preemptions_total", "kvscope:prefix_cache_hits_total",
                "kvscope:prefix_cache_queries_total"):
        if key in after:
            res[key.split(":")[1]] = after[key] - before.get(key, 0)
    return res


# ------------------------------------------------------------------------------------------ report
def _lengths(n: int, r: float) -> LengthDist:
    if r <= 0:
        return LengthDist("fixed", n, n)
    return LengthDist("uniform", max(1, int(n * (1 - r))), max(1, int(n * (1 + r))))


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


def main(argv=None) -> dict:
    args = parse_args(argv)
    proc = None
    try:
        if args.base_url:
            url = args.base_url
        else:
            proc, url, _ = launch_server(args)
        target = HttpTarget(url, model=args.model if args.base_url else None, api_key=args.api_key)
        spec = LoadSpec(name="bench_serve", num_requests=args.num_prompts, rate=args.request_rate,
                        burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                        prompt_len=_lengths(args.input_len, args.range_ratio),
                        output_len=_lengths(args.output_len, args.range_ratio), seed=args.seed,
                        temperature=0.0, ignore_eos=True)
        # warm-up: one short request, not counted
        warm = HttpLoadRunner(target, LoadSpec(name="warmup", num_requests=1, rate=math.inf,
                                               prompt_len=LengthDist("fixed", 16, 16),
                                               output_len=LengthDist("fixed", 4, 4), seed=args.seed + 999))
        warm.start().wait(120)
        if warm.errors:
            raise SystemExit(f"warm-up request failed: {warm.errors}")
        before = scrape(url)
        load_before = os.getloadavg()[0]
        runner = HttpLoadRunner(target, spec)
        print(f"benchmarking {runner.model} at {target.v1}: {args.num_prompts} prompts, rate "
              f"{args.request_rate:g} req/s, burstiness {args.burstiness:g}, input {args.input_len}, "
              f"output {args.output_len}, seed {args.seed}", flush=True)
        t0 = time.perf_counter()
        runner.start()
        while not runner.wait(5.0):
            print("  " + format_progress(runner.progress()), flush=True)
            if time.perf_counter() - t0 > args.timeout:
                runner.stop()
                runner.wait(30)
                break
        wall = time.perf_counter() - t0
        load_after = os.getloadavg()[0]
        after = scrape(url)
        s = runner.summary()
        srv = server_side(before, after)
        print_report(s, wall, args, srv)
        print(f"machine load average (1 min): {load_before:.2f} before, {load_after:.2f} after, "
              f"{os.cpu_count()} cores (other processes share these cores)")
        if runner.errors:
            print(f"{len(runner.errors)} errors, e.g. {runner.errors[:3]}")
        cpu = "cpu"
        try:
            cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1).strip()
        except Exception:  # noqa: BLE001
            pass
        name = args.name or slug(f"{runner.model}-{args.device if not args.base_url else 'remote'}-"
                                 f"r{args.request_rate:g}-n{args.num_prompts}")
        records = [dict(request_id=r.request_id, prompt_len=r.prompt_len, output_len=r.output_len,
                        ttft_ms=None if r.metrics.ttft is None else 1000 * r.metrics.ttft,
                        e2el_ms=None if r.metrics.e2e is None else 1000 * r.metrics.e2e,
                        num_chunks=len(r.metrics.token_times)) for r in runner.records]
        path = write_json(f"serve_{name}", {
            "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()},
            "target": target.v1, "model": runner.model, "launched": proc is not None,
            "client_host": f"{platform.node()} / {cpu} / {os.cpu_count()} cores", "duration_s": wall,
            "load_average_1min": {"before": load_before, "after": load_after},
            "summary": {k: v for k, v in s.items() if k != "slo"}, "server_side": srv,
            "http_status": s.get("http_status"), "errors": runner.errors[:20], "requests": records})
        print(f"wrote {path}")
        return s
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
