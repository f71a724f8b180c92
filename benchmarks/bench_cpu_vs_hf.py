"""CPU: kvscope vs HF `generate` served the simple way (batches of 8, padded, each batch runs to its
longest request), on the bundled SmolLM2, 32 requests with mixed prompt and output lengths, ignore_eos.
Only the requested tokens count. Prints a table and writes benchmarks/results/cpu_vs_hf.json.

    python benchmarks/bench_cpu_vs_hf.py [--requests 32] [--dtype float32]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, print_table, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.bundled import ensure_bundled  # noqa: E402


def workload(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outs = [rng.randint(16, 128) for _ in range(n)]
    return prompts, outs


def run_kvscope(prompts, outs, dtype, **cfg):
    llm = LLM(device="cpu", dtype=dtype, **cfg)
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    assert [len(r.token_ids) for r in res] == outs
    return dt


def run_hf(prompts, outs, dtype, batch=8):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(ensure_bundled()), dtype=getattr(torch, dtype)).eval()
    pad = 2
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False)  # warm-up
        t = time.perf_counter()
        for i in range(0, len(prompts), batch):
            ps, os_ = prompts[i:i + batch], outs[i:i + batch]
            L = max(len(p) for p in ps)
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in ps])          # left padding
            mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in ps])
            new = max(os_)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts, outs = workload(args.requests, args.seed, 49152)
    useful = sum(outs)
    t_kv = run_kvscope(prompts, outs, args.dtype)
    t_kv8 = run_kvscope(prompts, outs, args.dtype, max_num_seqs=8)
    t_ms = run_kvscope(prompts, outs, args.dtype, num_scheduler_steps=4)
    t_big = run_kvscope(prompts, outs, args.dtype, max_num_batched_tokens=2048)
    t_hf = run_hf(prompts, outs, args.dtype)
    rows = [
        dict(engine="HF generate, batches of 8 (padded)", seconds=t_hf, tok_s=useful / t_hf, ratio=1.0),
        dict(engine="kvscope, max_num_seqs=8", seconds=t_kv8, tok_s=useful / t_kv8, ratio=t_hf / t_kv8),
        dict(engine="kvscope (continuous batching)", seconds=t_kv, tok_s=useful / t_kv, ratio=t_hf / t_kv),
        dict(engine="kvscope, num_scheduler_steps=4", seconds=t_ms, tok_s=useful / t_ms, ratio=t_hf / t_ms),
        dict(engine="kvscope, max_num_batched_tokens=2048", seconds=t_big, tok_s=useful / t_big, ratio=t_hf / t_big),
    ]
    dev = device_name("cpu")
    path = write_json("cpu_vs_hf", dict(device=dev, dtype=args.dtype, requests=args.requests,
                                        useful_output_tokens=useful, prompt_tokens=sum(map(len, prompts)),
                                        rows=rows))
    print(f"\ndevice: {dev}; model: SmolLM2-135M-Instruct ({args.dtype}); {args.requests} requests, "
          f"prompts 16-256, outputs 16-128 (useful {useful} tokens); json: {path}")
    print_table(rows, ["engine", "seconds", "tok_s", "ratio"])


if __name__ == "__main__":
    main()
