"""GPU: the small-batch fused linear (engine/kernels/gemv.py) on a preset's four projections (Llama-3.2-1B by default) at batch 1,
swept over launch configs, against cuBLAS (F.linear) and the unfused kernels it replaces, as % of copy bandwidth.

Each timing is a CUDA-graph replay of calls that cycle through enough weight copies (>= 256 MB) that L2 never
holds the weight, as in a real decode step. Configs compile in parallel worker processes first.
Usage: python benchmarks/sweep_gemv.py [--quick] [--shape llama-3.1-8b]
(table last; JSON to benchmarks/results/gemv_<device>_<shape>.json)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_kernels import bench, ceilings  # noqa: E402
from benchmarks.common import device_name, slug, write_json  # noqa: E402
from engine.kernels import triton_ops as tk  # noqa: E402
from engine.kernels.gemv import gemv_config  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402



def shapes_for(preset: str) -> dict[str, tuple]:
    """name -> (N, K, prologue, residual): a preset's four decode-step linears."""
    c = preset_config(preset)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, Hk = c["num_attention_heads"], c["num_key_value_heads"]
    return {"qkv": ((H + 2 * Hk) * d, h, "rms_norm", False), "o": (h, H * d, None, True),
            "gate_up": (2 * i, h, "rms_norm", False), "down": (h, i, "silu_mul", True)}


def configs(quick: bool):
    grid = itertools.product((1, 2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (1, 2))
    out = [(bn, bk, w, s) for bn, bk, w, s in grid if 64 * w <= bn * bk <= 16384]
    return out[::4] if quick else out


def make(spec, M, copies=1):
    N, K, pro, res = spec
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, 2 * K if pro == "silu_mul" else K, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in range(copies)]
    nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16() if pro == "rms_norm" else None
    r = torch.randn(M, N, device="cuda", generator=g).bfloat16() if res else None
    return x, ws, nw, r


def call(spec, x, w, nw, r, cfg=None):
    return tk.fused_linear(x, w, prologue=spec[2], norm_weight=nw, eps=1e-5, residual=r, config=cfg)


def unfused(spec, x, w, nw, r):
    pro = spec[2]
    if pro == "rms_norm":
        x = tk.rms_norm(x, nw, 1e-5)[0]
    elif pro == "silu_mul":
        x = tk.silu_and_mul(x)
    y = F.linear(x, w)
    return y if r is None else y + r


def _compile(job):
    spec, M, cfg = job
    x, ws, nw, r = make(spec, M)
    try:
        call(spec, x, ws[0], nw, r, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def graph_us(fn, ws) -> float:
    """Per-call microseconds of fn(w) over a graph that cycles twice through the weight copies."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for w in ws[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):
            for w in ws:
                fn(w)
    return bench(g.replay, warmup=5, rep=40) * 1e3 / (2 * len(ws))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", default="llama-3.2-1b", help="a preset whose linears to sweep")
    args = ap.parse_args()
    shapes = shapes_for(args.shape)
    t0 = time.time()
    dev = device_name()
    ceil = ceilings()
    bw = ceil["copy_GBps"]
    cfgs = configs(args.quick)
    jobs = [(spec, 1, c) for spec in shapes.values() for c in cfgs]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 2), mp_context=ctx) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs)))
    print(f"compiled {len(jobs)} configs in {time.time() - t0:.0f} s ({sum(e is not None for e in errors.values())} failed)",
          flush=True)
    rows, best = [], {}
    for name, spec in shapes.items():
        N, K, pro, res = spec
        wbytes = N * K * 2
        copies = max(2, -(-256 * 2 ** 20 // wbytes))
        x, ws, nw, r = make(spec, 1, copies)
        ref = unfused(spec, x.float(), ws[0].float(), None if nw is None else nw.float(), None if r is None else r.float())
        sweep = []
        for c in cfgs:
            if errors.get((spec, 1, c)):
                continue
            err = ((call(spec, x, ws[0], nw, r, c).float() - ref).norm() / ref.norm()).item()
            us = graph_us(lambda w, c=c: call(spec, x, w, nw, r, c), ws)
            sweep.append(dict(shape=name, M=1, cfg=c, us=us, pct_copy=100 * wbytes / us / 1e3 / bw, rel_err=err))
        sweep.sort(key=lambda d: d["us"])
        best[name] = sweep[0]["cfg"]
        print(f"{name}: best {sweep[:3]}", flush=True)
        for M in (1, 2, 4, 8):
            x, ws, nw, r = make(spec, M, copies)
            xk = x[:, :K].contiguous()                      # cuBLAS alone: the plain [M, K] input
            row = dict(shape=name, N=N, K=K, M=M, prologue=pro, residual=res, weight_MB=wbytes / 1e6)
            for label, fn in (("best", lambda w: call(spec, x, w, nw, r, best[name])),
                              ("heuristic", lambda w: call(spec, x, w, nw, r)),
                              ("cublas", lambda w: F.linear(xk, w)),
                              ("unfused", lambda w: unfused(spec, x, w, nw, r))):
                us = graph_us(fn, ws)
                row[f"{label}_us"] = us
                row[f"{label}_pct"] = 100 * wbytes / us / 1e3 / bw
            row["best_cfg"] = best[name]
            row["heuristic_cfg"] = gemv_config(M, N, K)
            rows.append(row)
            print(row, flush=True)
        rows.append(dict(shape=name, sweep=sweep[:12]))
        del x, ws
        torch.cuda.empty_cache()
    out = dict(device=dev, ceilings=ceil, best=best, rows=rows, seconds=time.time() - t0)
    path = write_json(f"gemv_{slug(dev)}_{args.shape}", out)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], path.name), "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(f"\n{dev}: copy {bw:.0f} GB/s; per call us (% of copy bandwidth), weights streamed from HBM")
    print(f"{'shape':8s} {'M':>2s} {'MB':>6s} {'fused best':>16s} {'fused heur':>16s} {'cuBLAS':>16s} {'unfused':>16s}  best cfg")
    for r in rows:
        if "M" in r:
            print(f"{r['shape']:8s} {r['M']:2d} {r['weight_MB']:6.1f} " + " ".join(
                f"{r[k + '_us']:8.1f} ({r[k + '_pct']:4.0f}%)" for k in ("best", "heuristic", "cublas", "unfused"))
                + f"  {r['best_cfg']}")
    print(f"best: {json.dumps(best)}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
