"""One serving workload sent from several client processes at once (`bench_serve.py --client-procs N`).

A single Python client process handling hundreds of concurrent streams is itself a bottleneck: in a burst
it sends request 500 long after request 1, and reads first chunks late, so the TTFT and throughput it
reports include its own event loop's queue. Here each of N spawned processes runs an `HttpLoadRunner` on
every N-th simulated user of the same seeded workload; all start at one agreed `time.perf_counter()`
instant (CLOCK_MONOTONIC, one clock for the machine's processes), so arrival times keep their meaning,
and the parent merges their records. Results travel back as JSON.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import multiprocessing as mp
import time

from engine.outputs import RequestMetrics
from engine.runtime.gc_utils import freeze_gc_heap
from inspector.load import LengthDist, LoadSpec
from inspector.recorder import RequestRecord

START_MARGIN_S = 1.0           # from the last child saying ready to the common start (connections open meanwhile)


def _lengths(n: int, r: float) -> LengthDist:
    if r <= 0:
        return LengthDist("fixed", n, n)
    return LengthDist("uniform", max(1, int(n * (1 - r))), max(1, int(n * (1 + r))))


def spec_kwargs(w) -> dict:
    return dict(num_prompts=w.num_prompts, request_rate=w.request_rate, burstiness=w.burstiness,
                max_concurrency=w.max_concurrency, input_len=w.input_len, output_len=w.output_len,
                range_ratio=w.range_ratio, seed=w.seed, prompts=getattr(w, "prompts", "random"),
                num_turns=getattr(w, "num_turns", 1), shared_prefix_len=getattr(w, "shared_prefix_len", 0))


def make_spec(num_prompts, request_rate, burstiness, max_concurrency, input_len, output_len, range_ratio, seed,
              client_procs: int = 1, prompts: str = "random", num_turns: int = 1, shared_prefix_len: int = 0
              ) -> LoadSpec:
    """prompts "text": chat turns of the bundled text set in the served model's template (needs its tokenizer);
    num_turns > 1: multi-turn chats, each turn's prompt the whole conversation so far."""
    conc = max_concurrency if not max_concurrency or client_procs == 1 else -(-max_concurrency // client_procs)
    return LoadSpec(name="bench_serve", num_requests=num_prompts, rate=request_rate, burstiness=burstiness,
                    max_concurrency=conc, prompt_len=_lengths(input_len, range_ratio),
                    output_len=_lengths(output_len, range_ratio), seed=seed, temperature=0.0, ignore_eos=True,
                    prompt_source="text" if prompts == "text" else "random ids", num_turns=num_turns,
                    shared_prefix_len=shared_prefix_len)


def make_runner(url: str, model: str | None, api_key: str | None, spec: LoadSpec, vocab_size: int, client: str,
                tokenizer_model: str | None, **kw):
    """The load runner of `client` ("aiohttp": inspector's HttpLoadRunner; "openai": the official client), with
    the tokenizer of `tokenizer_model` when the prompts are text."""
    from inspector.http_load import HttpLoadRunner, HttpTarget
    tok = None
    if spec.prompt_source == "text":
        from engine.models.loader import load_tokenizer, resolve
        tok = load_tokenizer(resolve(tokenizer_model)[2])
    cls = HttpLoadRunner
    if client == "openai":
        from benchmarks.openai_client import OpenAIClientRunner
        cls = OpenAIClientRunner
    return cls(HttpTarget(url, model=model, api_key=api_key), spec, vocab_size=vocab_size, tokenizer=tok, **kw)


def _child(conn, url: str, model: str | None, api_key: str | None, workload: dict, vocab_size: int,
           k: int, n: int, timeout: float, warm: bool, client: str, tokenizer_model: str | None) -> None:
    try:
        runner = make_runner(url, model, api_key, make_spec(**workload), vocab_size, client, tokenizer_model,
                             shard=(k, n), warm_connections=warm)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return
    freeze_gc_heap()
    # No collection during the run: a full one over the streams in flight pauses this process 60-150 ms, and
    # every stream it reads would show that pause as the server's chunk gap. The run's garbage is reclaimed
    # after it (reference counting frees most of it as it goes).
    gc.disable()
    conn.send_bytes(json.dumps({"ready": len(runner.items)}).encode())
    at = json.loads(conn.recv_bytes())["at"]
    runner.start(at=at)
    if not runner.wait(timeout):
        runner.stop()
        runner.wait(30)
    gc.enable()
    recs = [dict(dataclasses.asdict(r), metrics=dataclasses.asdict(r.metrics)) for r in runner.records]
    p = runner.progress()
    conn.send_bytes(json.dumps({"records": recs, "errors": runner.errors, "failed": p["failed"],
                                "not_sent": p["not_sent"], "model": runner.model,
                                "http_status": p["http_status"]}).encode())


def run_sharded(url: str, model: str | None, api_key: str | None, workload: dict, vocab_size: int,
                n: int, timeout: float, warm: bool = False, client: str = "aiohttp",
                tokenizer_model: str | None = None) -> dict:
    """Run the workload `make_spec(**workload)` from n processes (with `warm`, each opens its connections
    before the start). Returns {records, errors, failed,
    not_sent, model, http_status, t_start, t_end}: t_start is the agreed start, t_end when the last
    process finished."""
    ctx = mp.get_context("spawn")          # the parent may hold CUDA (an offline target ran first)
    pipes, procs = [], []
    for k in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child, args=(child, url, model, api_key, workload, vocab_size, k, n, timeout, warm, client,
                                          tokenizer_model),
                        daemon=True, name=f"bench-client-{k}")
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    try:
        for conn in pipes:
            if not conn.poll(120):
                raise SystemExit("a client process did not start within 120 s")
            msg = json.loads(conn.recv_bytes())
            if "error" in msg:
                raise SystemExit(f"client process: {msg['error']}")
        at = time.perf_counter() + START_MARGIN_S
        for conn in pipes:
            conn.send_bytes(json.dumps({"at": at}).encode())
        out = {"records": [], "errors": [], "failed": 0, "not_sent": 0, "http_status": {}, "t_start": at}
        for conn in pipes:
            if not conn.poll(timeout + 60):
                raise SystemExit("a client process did not report")
            msg = json.loads(conn.recv_bytes())
            out["model"] = msg["model"]
            out["errors"] += msg["errors"]
            out["failed"] += msg["failed"]
            out["not_sent"] += msg["not_sent"]
            for code, c in msg["http_status"].items():
                out["http_status"][code] = out["http_status"].get(code, 0) + c
            for r in msg["records"]:
                r["metrics"] = RequestMetrics(**r["metrics"])
                out["records"].append(RequestRecord(**r))
        out["t_end"] = time.perf_counter()
        return out
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
