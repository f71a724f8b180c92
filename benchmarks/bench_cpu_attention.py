"""kvscope::decode_attention on CPU: the C++ kernel (engine/kernels/cpu_kernels.py) against the torch
implementation it replaced (torch_ops.decode_attention_ref), microseconds per call at the bundled SmolLM2's shape
(9 query heads, 3 KV heads, head size 64, 16-token blocks, fp32 caches), every sequence at the same context.

Two calls are timed: "store+attend", the op as the model calls it (this step's K/V stored, then the attention),
and "attend", the decode attention over a cache that already holds the step's K/V
(torch_ops.paged_attention's decode branch: torch's gather + SDPA against the C++ kernel with nothing to store).
Each figure is the best of --repeats runs of the median over --iters calls.

--engine int4 (or none) adds the end to end figure: the bundled model generating --tokens greedy tokens at batch
1 and 8 with the layers' torch ops (`cpu_decode_layer=False`: the op reached through the dispatcher), once with the
C++ kernel and once with the torch implementation registered over it for the CPU key, alternating in one process
(best of --engine-repeats each).

    python benchmarks/bench_cpu_attention.py [--batch 1 8] [--context 128 1024] [--threads 2] [--engine int4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_cpu_llamacpp import commit  # noqa: E402
from benchmarks.common import device_name, print_table, write_json  # noqa: E402
from engine.kernels import cpu_kernels, torch_ops  # noqa: E402

H, HK, D, BS = 9, 3, 64, 16


def case(B: int, ctx: int, dtype: torch.dtype):
    """Caches with each sequence's blocks scattered over the pool; this step's token at position ctx - 1."""
    nb = -(-ctx // BS)
    N = B * nb + 1
    perm = torch.randperm(N - 1) + 1
    tables = perm.view(B, nb).int()
    kc, vc = torch.randn(N, BS, HK, D).to(dtype), torch.randn(N, BS, HK, D).to(dtype)
    qkv = torch.randn(B, (H + 2 * HK) * D)
    q, k, v = qkv.split([H * D, HK * D, HK * D], dim=-1)
    q, k, v = q.view(B, H, D), k.view(B, HK, D), v.view(B, HK, D)
    pos = torch.full((B,), ctx - 1)
    slots = tables[torch.arange(B), pos // BS].long() * BS + pos % BS
    return q, k, v, kc, vc, slots, tables, torch.full((B,), ctx, dtype=torch.int32)


def time_us(fn, iters: int, repeats: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        best = min(best, statistics.median(ts))
    return best * 1e6


def engine_rows(quantization: str, tokens: int, repeats: int) -> list[dict]:
    from engine import LLM, SamplingParams
    prompt = "Once upon a time, in a small village by the sea,"
    q = None if quantization == "none" else quantization
    extra = {"int4_group_size": 32} if q == "int4" else {}
    p = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens)
    rows = []
    llm = LLM(device="cpu", quantization=q, max_model_len=1024, cpu_decode_layer=False, **extra)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    best: dict[tuple[int, str], float] = {}
    for _ in range(repeats):
        for B in (1, 8):
            for kernel in ("C++", "torch"):
                lib = None
                if kernel == "torch":            # the torch implementation over the C++ kernel, for this run
                    lib = torch.library.Library("kvscope", "IMPL")
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", UserWarning)   # "Overriding a previously registered kernel"
                        lib.impl("decode_attention", torch_ops.decode_attention_ref, "CPU")
                t = time.perf_counter()
                llm.generate([prompt] * B, p, use_tqdm=False)
                best[B, kernel] = max(best.get((B, kernel), 0.0), tokens * B / (time.perf_counter() - t))
                if lib is not None:
                    lib._destroy()
    for B in (1, 8):
        rows.append({"engine": f"kvscope {quantization}, layer torch ops", "batch": B,
                     "torch tok/s": round(best[B, "torch"], 1), "C++ tok/s": round(best[B, "C++"], 1),
                     "speed-up": round(best[B, "C++"] / best[B, "torch"], 2)})
    del llm
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engine", choices=["int4", "none"], help="also the end-to-end A/B on the bundled model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--engine-repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None:
        sys.exit("the C++ CPU kernel could not be built")
    dtype = getattr(torch, args.dtype)
    load_before = os.getloadavg()
    op, ref = torch.ops.kvscope.decode_attention.default, torch_ops.decode_attention_ref
    rows = []
    with torch.inference_mode():
        for B in args.batch:
            for ctx in args.context:
                q, k, v, kc, vc, slots, tables, lens = case(B, ctx, dtype)
                none, k0 = slots[:0], k[:0]
                lens_cpu = lens.tolist()
                t = {
                    "store+attend torch": lambda: ref(q, k, v, kc, vc, slots, tables, lens, D ** -0.5),
                    "store+attend C++": lambda: op(q, k, v, kc, vc, slots, tables, lens, D ** -0.5),
                    "attend torch": lambda: torch_ops._decode_attention(q, kc, vc, tables, lens, lens_cpu, D ** -0.5),
                    "attend C++": lambda: op(q, k0, k0, kc, vc, none, tables, lens, D ** -0.5),
                }
                us = {name: time_us(fn, args.iters, args.repeats) for name, fn in t.items()}
                rows.append({"batch": B, "context": ctx, **{f"{n} us": round(x, 1) for n, x in us.items()},
                             "store+attend speed-up": round(us["store+attend torch"] / us["store+attend C++"], 1),
                             "attend speed-up": round(us["attend torch"] / us["attend C++"], 1)})
    print_table(rows, list(rows[0]))
    e2e = engine_rows(args.engine, args.tokens, args.engine_repeats) if args.engine else []
    if e2e:
        print()
        print_table(e2e, list(e2e[0]))
    load = {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]}
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}; {args.threads} threads")
    path = write_json("cpu_attention", {"device": device_name("cpu"), "threads": args.threads, "dtype": args.dtype,
                                        "commit": commit(),
                                        "command": " ".join(sys.argv), "load_average": load, "rows": rows,
                                        "engine_rows": e2e})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
