"""GPU: the quantized small-batch fused linear (engine/kernels/quant_gemv.py) on a preset's four projections
(Llama-3.1-8B by default) at batch 1, per format (fp8, int8, int4), swept over launch configs
(BLOCK_N, BLOCK_K, num_warps, CVT, PRE), against the bf16 fused linear (engine/kernels/gemv.py) on the same
shape, as GB/s of weight bytes (codes + scales) and % of the measured copy bandwidth.

Each timing is a CUDA-graph replay of calls that cycle through enough weight copies (>= 256 MB) that L2 never
holds the weight, as in a real decode step; configs compile in parallel worker processes first (a kernel
variant is compiled once per format and prologue: projections with the same fusions share it). The best
config is timed again with each of the format's other decodes (CVT: conversion instructions vs bit operations),
and quant_gemm.py's tensor-core kernel (M padded to 16, no fusions) is timed beside it.
Prints the table last, and a QUANT_GEMV_CONFIGS literal of the winners to paste into engine/kernels/quant_gemv.py.
Usage:
    python benchmarks/sweep_quant_gemv.py [--shape llama-3.1-8b] [--formats fp8,int8,int4] [--quick]
JSON to benchmarks/results/quant_gemv_<device>_<shape>.json (and $OUT/ when set).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bench_kernels import ceilings  # noqa: E402
from benchmarks.common import device_name, slug, write_json  # noqa: E402
from benchmarks.sweep_gemv import graph_us, shapes_for  # noqa: E402
from engine.kernels import triton_ops as tk  # noqa: E402
from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref  # noqa: E402
from engine.kernels.quant_gemv import quant_fused_linear, quant_fused_linear_ref, quant_gemv_config  # noqa: E402
from engine.quant.formats import quantize  # noqa: E402

FORMATS = ("fp8", "int8", "int4")


CVTS = {"fp8": (0, 1), "int8": (0, 1, 2), "int4": (0, 1)}     # the decodes each format has (quant_gemv.py)
SWEPT_CVTS = {"fp8": (0, 1), "int8": (1, 2), "int4": (0, 1)}   # int8's CVT 0 only at the best config


# quant_gemm.py's tensor-core kernel at M = 1 (padded to BLOCK_M 16), weight-only, no fusions: is a tl.dot path
# worth building for decode? (BLOCK_M, BLOCK_N, num_warps, num_stages)
GEMM_CONFIGS = ((16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (16, 64, 2, 4))


def configs(fmt: str, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, CVT, PRE) with 16 to 256 weights per thread per k-tile. quick: the
    neighbourhood of the earlier sweeps' winners (BLOCK_N 4-16, BLOCK_K 1-2k)."""
    out = []
    for warps in (1, 2, 4):                                  # 8 never won in the first sweep
        for bn in (4, 8, 16) if quick else (2, 4, 8, 16):
            for bk in (1024, 2048) if quick else (1024, 2048, 4096):
                if 512 * warps <= bn * bk <= 8192 * warps:
                    for pre in (0, 1):
                        for cvt in SWEPT_CVTS[fmt]:
                            out.append((bn, bk, warps, cvt, pre))
    return out


def make(fmt, spec, copies=1):
    """Activation, `copies` quantized weights (the same values), norm weight, residual for a shape."""
    N, K, pro, res = spec
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 2 * K if pro == "silu_mul" else K, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    if fmt == "bf16":
        ts = [w.bfloat16() for _ in range(copies)]
    else:
        t = quantize(w, fmt)
        ts = [t] + [{k: v.clone() for k, v in t.items()} for _ in range(copies - 1)]
    nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16() if pro == "rms_norm" else None
    r = torch.randn(1, N, device="cuda", generator=g).bfloat16() if res else None
    return x, ts, nw, r


def nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return sum(v.numel() * v.element_size() for v in t.values())


def call(fmt, spec, x, t, nw, r, cfg=None):
    N, K, pro, _ = spec
    if fmt == "bf16":
        return tk.fused_linear(x, t, prologue=pro, norm_weight=nw, eps=1e-5, residual=r)
    return quant_fused_linear(x, fmt, t, (N, K), prologue=pro, norm_weight=nw, eps=1e-5, residual=r, config=cfg)


def _compile(job):
    fmt, spec, cfg = job
    N, K, pro, res = spec
    x, ts, nw, r = make(fmt, (min(N, 1024), K, pro, res))       # same specialisation as the full shape
    try:
        if len(cfg) == 4:                                        # a GEMM config
            quant_matmul(x[:, :K].contiguous(), fmt, ts[0], (min(N, 1024), K), config=cfg)
        else:
            call(fmt, (min(N, 1024), K, pro, res), x, ts[0], nw, r, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:100]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", help="a preset whose linears to sweep")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--quick", action="store_true", help="a smaller grid (see configs)")
    args = ap.parse_args()
    t0 = time.time()
    shapes = shapes_for(args.shape)
    fmts = args.formats.split(",")
    dev = device_name()
    ceil = ceilings()
    bw = ceil["copy_GBps"]
    # one compile per kernel variant: (format, prologue, residual, config)
    variants, jobs = {}, []
    for fmt in fmts:
        for spec in shapes.values():
            for c in configs(fmt, args.quick):
                key = (fmt, spec[2], spec[3], c)
                if key not in variants:
                    variants[key] = len(jobs)
                    jobs.append((fmt, spec, c))
        for c in GEMM_CONFIGS:                                   # one compile per format: no fusions
            variants[(fmt, "gemm", c)] = len(jobs)
            jobs.append((fmt, next(iter(shapes.values())), c))
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 2), mp_context=ctx) as pool:
        results = list(pool.map(_compile, jobs))
    errors = {k: results[i] for k, i in variants.items()}
    failed = [(k, e) for k, e in errors.items() if e]
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s ({len(failed)} failed)", flush=True)
    for k, e in failed[:5]:
        print("  failed:", k, e, flush=True)

    rows, sweeps, best = [], {}, {}
    for name, spec in shapes.items():
        N, K, pro, res = spec
        copies = max(2, -(-256 * 2 ** 20 // (N * K)))            # >= 256 MB of 1-byte weights
        x, ws, nw, r = make("bf16", spec, copies)
        bf16_us = graph_us(lambda w: call("bf16", spec, x, w, nw, r), ws)
        bf16_bytes = nbytes(ws[0])
        del ws
        torch.cuda.empty_cache()
        for fmt in fmts:
            x, ts, nw, r = make(fmt, spec, copies)
            ref = quant_fused_linear_ref(x.float(), fmt, ts[0], (N, K), prologue=pro,
                                         norm_weight=None if nw is None else nw.float(), eps=1e-5,
                                         residual=None if r is None else r.float())
            wb = nbytes(ts[0])

            def measure(c):
                err = float((call(fmt, spec, x, ts[0], nw, r, c).float() - ref).norm() / ref.norm())
                us = graph_us(lambda t: call(fmt, spec, x, t, nw, r, c), ts)
                return dict(cfg=c, us=us, GBps=wb / us / 1e3, pct_copy=100 * wb / us / 1e3 / bw, rel_err=err)

            sweep = [measure(c) for c in configs(fmt, args.quick) if not errors.get((fmt, pro, res, c))]
            ok = [s for s in sweep if s["rel_err"] < 1e-2]
            ok.sort(key=lambda d: d["us"])
            if not ok:
                print(f"{fmt} {name}: no config passed ({sweep[:2]})", flush=True)
                continue
            top = ok[0]
            c = top["cfg"]
            by_cvt = {v: (top if v == c[3] else measure((*c[:3], v, c[4])))["us"] for v in CVTS[fmt]}
            table_cfg = quant_gemv_config(fmt, 1, N, K)
            table = measure(table_cfg)
            xk = x[:, :K].contiguous()                          # the GEMM's plain [1, K] input
            gref = quant_matmul_ref(xk.float(), fmt, ts[0], (N, K))
            gemm = []
            for gc in GEMM_CONFIGS:
                if errors.get((fmt, "gemm", gc)):
                    continue
                gerr = float((quant_matmul(xk, fmt, ts[0], (N, K), config=gc).float() - gref).norm() / gref.norm())
                if gerr < 1e-2:
                    gemm.append((graph_us(lambda t, gc=gc: quant_matmul(xk, fmt, t, (N, K), config=gc), ts), gc))
            gemm_us, gemm_cfg = min(gemm) if gemm else (float("nan"), None)
            best[(fmt, N, K)] = top["cfg"]
            sweeps[f"{fmt}/{name}"] = ok[:10]
            row = dict(format=fmt, shape=name, N=N, K=K, prologue=pro, residual=res, MB=wb / 1e6,
                       best_cfg=top["cfg"], best_us=top["us"], best_GBps=top["GBps"], best_pct=top["pct_copy"],
                       best_rel_err=top["rel_err"], us_by_cvt=by_cvt,
                       table_cfg=table_cfg, table_us=table["us"], table_pct=table["pct_copy"],
                       gemm_us=gemm_us, gemm_pct=100 * wb / gemm_us / 1e3 / bw, gemm_cfg=gemm_cfg,
                       bf16_us=bf16_us, bf16_pct=100 * bf16_bytes / bf16_us / 1e3 / bw,
                       speedup_vs_bf16=bf16_us / top["us"], floor_us=wb / bw / 1e3)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            ts = None
            torch.cuda.empty_cache()
    out = dict(device=dev, shape=args.shape, ceilings=ceil, rows=rows, sweeps=sweeps,
               best={f"{f},{n},{k}": c for (f, n, k), c in best.items()}, seconds=time.time() - t0)
    path = write_json(f"quant_gemv_{slug(dev)}_{args.shape}", out)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], path.name), "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(f"\n{dev}: copy {bw:.0f} GB/s; {args.shape} at M = 1; per call us (% of copy bandwidth, weight bytes "
          f"incl. scales); weights streamed from HBM; json: {path}")
    print(f"{'fmt':5s} {'shape':8s} {'MB':>6s} {'floor':>6s} {'best':>15s} {'GB/s':>6s} {'CVT 0/1/2':>17s} "
          f"{'table cfg':>15s} {'GEMM (tl.dot)':>15s} {'bf16 fused':>15s} {'x bf16':>6s}  best cfg "
          f"(BN, BK, warps, CVT, PRE)")
    for r in rows:
        cvts = "/".join(f"{r['us_by_cvt'][v]:.1f}" for v in sorted(r["us_by_cvt"]))
        print(f"{r['format']:5s} {r['shape']:8s} {r['MB']:6.1f} {r['floor_us']:6.1f} "
              f"{r['best_us']:7.1f} ({r['best_pct']:3.0f}%) {r['best_GBps']:6.0f} {cvts:>17s} "
              + " ".join(f"{r[k + '_us']:7.1f} ({r[k + '_pct']:3.0f}%)" for k in ("table", "gemm", "bf16"))
              + f" {r['speedup_vs_bf16']:6.2f}  {r['best_cfg']}")
    print("\n# paste into engine/kernels/quant_gemv.py (merging entries of other shapes):")
    print("QUANT_GEMV_CONFIGS.update({")
    for (f, n, k), c in best.items():
        print(f"    ({f!r}, {n}, {k}): {tuple(c)},")
    print("})")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
