"""Prefix caching on vs off on two chat workloads:

  shared-system   every request = one long shared system prompt + a short unique question
  multi-turn      each user's next turn resends the whole conversation so far (prompt + answers)

Requests arrive over time (Poisson, seeded); TTFT = first token - arrival. Reports TTFT p50/p90,
output tok/s and the prefix-cache hit rate (hits / queried prompt tokens).

    python benchmarks/bench_prefix.py [--model dummy:llama-3.2-1b] [--scale 1.0]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLMEngine, SamplingParams  # noqa: E402


def drive(engine: LLMEngine, arrivals: list[tuple[float, list[int], int, object]], follow_up=None):
    """arrivals: (offset s, prompt ids, max_tokens, tag). follow_up(tag, output) -> new arrival or None.
    Returns the finished outputs."""
    pending = sorted(arrivals, key=lambda a: a[0])
    t0 = time.perf_counter()
    tags, done = {}, []
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            off, ids, mt, tag = pending.pop(0)
            rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=mt, ignore_eos=True),
                                     arrival_time=t0 + off)
            tags[rid] = tag
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[0][0] - now)))
            continue
        for out in engine.step():
            if out.finished:
                done.append(out)
                nxt = follow_up(tags[out.request_id], out) if follow_up else None
                if nxt is not None:
                    pending.append((time.perf_counter() - t0, *nxt))
                    pending.sort(key=lambda a: a[0])
    return done, time.perf_counter() - t0


def shared_system(rng, n, rate, sys_len, q_len, out_len, vocab):
    system = [rng.randrange(100, vocab) for _ in range(sys_len)]
    t, arr = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        arr.append((t, system + [rng.randrange(100, vocab) for _ in range(q_len)], out_len, i))
    return arr, None


def multi_turn(rng, users, turns, rate, first_len, msg_len, out_len, vocab):
    t, arr = 0.0, []
    for u in range(users):
        t += rng.expovariate(rate)
        arr.append((t, [rng.randrange(100, vocab) for _ in range(first_len)], out_len, (u, 1)))

    def follow(tag, out):
        u, k = tag
        if k >= turns:
            return None
        ids = out.prompt_token_ids + out.token_ids + [rng.randrange(100, vocab) for _ in range(msg_len)]
        return ids, out_len, (u, k + 1)
    return arr, follow


def run(model: str, workload: str, prefix: bool, scale: float, device: str, seed: int = 0):
    eng = LLMEngine(model=model, device=device, enable_prefix_caching=prefix, max_num_seqs=64,
                    max_model_len=4096, **({"cpu_kv_cache_gib": 1.0} if device == "cpu" else {}))
    vocab = min(eng.arch_config.vocab_size, 49152)
    rng = random.Random(seed)
    gpu = eng.device.type == "cuda"
    if workload == "shared-system":
        arr, follow = shared_system(rng, int((128 if gpu else 24) * scale), rate=(40.0 if gpu else 2.0),
                                    sys_len=1024 if gpu else 384, q_len=32, out_len=32 if gpu else 16, vocab=vocab)
    else:
        arr, follow = multi_turn(rng, int((32 if gpu else 6) * scale), turns=4, rate=(20.0 if gpu else 1.0),
                                 first_len=512 if gpu else 192, msg_len=48, out_len=48 if gpu else 16, vocab=vocab)
    done, wall = drive(eng, arr, follow)
    ttft = np.array([o.metrics.ttft for o in done]) * 1e3
    st = eng.stats()
    out_tokens = sum(len(o.token_ids) for o in done)
    eng.close()
    return dict(workload=workload, prefix_caching="on" if prefix else "off", requests=len(done),
                ttft_p50_ms=float(np.percentile(ttft, 50)), ttft_p90_ms=float(np.percentile(ttft, 90)),
                out_tok_s=out_tokens / wall, seconds=wall,
                hit_rate=st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2 on CPU, dummy:llama-3.2-1b on CUDA")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    import torch
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("dummy:llama-3.2-1b" if device == "cuda" else None)
    rows = [run(model, w, p, args.scale, device) for w in ("shared-system", "multi-turn") for p in (False, True)]
    dev = device_name(device)
    path = write_json(f"prefix_{slug(dev)}", dict(device=dev, model=model or "SmolLM2-135M-Instruct", rows=rows))
    print(f"\ndevice: {dev}; model: {model or 'SmolLM2-135M-Instruct (bundled)'}; json: {path}")
    print_table(rows, ["workload", "prefix_caching", "requests", "ttft_p50_ms", "ttft_p90_ms", "out_tok_s",
                       "hit_rate"])


if __name__ == "__main__":
    main()
