"""GPU: the quantized small-batch fused linear on a preset's four projections (Llama-3.1-8B by default) at batch 1,
per format (fp8, int8, int4): the CUDA-core kernel (engine/kernels/quant_gemv.py, configs (BLOCK_N, BLOCK_K,
num_warps, CVT, PRE)) and the tensor-core one (quant_gemv_tc.py, configs (BLOCK_N, BLOCK_K, num_warps,
num_stages, DOT)), each swept over launch configs, against the bf16 fused linear (engine/kernels/gemv.py) on the
same shape, as GB/s of weight bytes (codes + scales) and % of the measured copy bandwidth; then per layer (the
four projections summed) per format and kernel.

Each timing is a CUDA-graph replay of calls that cycle through enough weight copies (>= 256 MB) that L2 never
holds the weight, as in a real decode step; configs compile in parallel worker processes first (a kernel
variant is compiled once per format and prologue: projections with the same fusions share it). The best
config is timed again with each of the format's other decodes (CVT: conversion instructions vs bit operations),
and quant_gemm.py's tensor-core kernel (M padded to 16, no fusions) is timed beside it.
Prints the tables last, and QUANT_GEMV_CONFIGS / QUANT_GEMV_TC_CONFIGS literals of the winners to paste into
engine/kernels/quant_gemv.py / quant_gemv_tc.py.
Usage:
    python benchmarks/sweep_quant_gemv.py [--shape llama-3.1-8b] [--formats fp8,int8,int4] [--quick]
                                          [--kernels cuda,tc]
JSON to benchmarks/results/quant_gemv_<device>_<shape>.json.
"""
from __future__ import annotations

import argparse
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
from engine.kernels.quant_gemv_packed import quant_fused_linear_packed  # noqa: E402
from engine.kernels.quant_packed_configs import quant_gemv_packed_config  # noqa: E402
from engine.kernels.quant_gemv_tc import quant_gemv_tc_config  # noqa: E402
from engine.quant.formats import int4_to_words, quantize  # noqa: E402

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


# DOT: bit 0 fp16 operands, bit 1 int4's packed inline-PTX decode; int8 -> fp16 is a conversion a weight: not swept
TC_DOTS = {"fp8": (1, 0), "int8": (0,), "int4": (1, 0, 3, 2)}
QUICK_TC_DOTS = {"fp8": (1,), "int8": (0,), "int4": (1, 3)}    # the rest timed at the best config only


def tc_configs(fmt: str, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, DOT) of the tensor-core kernel: BLOCK_N rows of mma tiles 8
    wide, at most one warp per 8 rows. quick: 4 stages, BLOCK_N 16-64, BLOCK_K 256-512, fp16 dots."""
    out = []
    for bn in (16, 32, 64) if quick else (16, 32, 64, 128):
        for warps in (1, 2, 4) if quick else (1, 2, 4, 8):
            if warps * 8 > bn or (quick and warps == 1 and bn > 16) or (quick and warps == 4 and bn == 16):
                continue
            for bk in (256, 512) if quick else (128, 256, 512, 1024):
                for stages in (4,) if quick else (2, 3, 4, 6):
                    for dot in (QUICK_TC_DOTS if quick else TC_DOTS)[fmt]:
                        out.append((bn, bk, warps, stages, dot))
    return out


def pk_configs(fmt: str, quick: bool) -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_N, BLOCK_K, num_warps, SPLIT, FLAGS) of the packed-word GEMV (quant_gemv_packed.py): 16-64 rows on
    1-4 warps, two k-tile widths, split-K 1/2/4 (timed on the shapes with N <= 8192 only), the inline-PTX decode
    with and without the next tile's early load (FLAGS 1 / 3; the plain decode timed at the best config)."""
    out = []
    bks = (512, 1024) if fmt == "int4" else (256, 512) if quick else (256, 512, 1024)
    for bn, warps in ((16, 1), (32, 2), (64, 4)) if quick else ((8, 1), (16, 1), (32, 1), (32, 2), (64, 4)):
        if fmt == "fp8" and 128 % bn:
            continue
        for bk in bks:
            for split in (1, 2, 4):
                for flags in (1, 3):
                    out.append((bn, bk, warps, split, flags))
    return out


PK_FLAGS = (0, 1, 2, 3)


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


def call(fmt, spec, x, t, nw, r, cfg=None, tc=False):
    """tc: True the tensor-core GEMV, False the CUDA-core one, "packed" the packed-word one (int4: words layout)."""
    N, K, pro, _ = spec
    if fmt == "bf16":
        return tk.fused_linear(x, t, prologue=pro, norm_weight=nw, eps=1e-5, residual=r)
    if tc == "packed":
        return quant_fused_linear_packed(x, fmt, t, (N, K), prologue=pro, norm_weight=nw, eps=1e-5, residual=r,
                                         config=cfg)
    return quant_fused_linear(x, fmt, t, (N, K), prologue=pro, norm_weight=nw, eps=1e-5, residual=r,
                              tensor_cores=tc, config=cfg)


def _compile(job):
    fmt, spec, cfg, kind = job
    N, K, pro, res = spec
    x, ts, nw, r = make(fmt, (min(N, 1024), K, pro, res))       # same specialisation as the full shape
    if kind == "packed" and fmt == "int4":
        ts = [int4_to_words(ts[0])]
    try:
        if kind == "gemm":
            quant_matmul(x[:, :K].contiguous(), fmt, ts[0], (min(N, 1024), K), config=cfg)
        else:
            call(fmt, (min(N, 1024), K, pro, res), x, ts[0], nw, r, cfg, tc=KIND_ARG[kind])
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:100]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", help="a preset whose linears to sweep")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--no-gemm", action="store_true", help="skip quant_gemm.py's tl.dot kernel at M = 1")
    ap.add_argument("--quick", action="store_true", help="smaller grids (see configs, tc_configs)")
    ap.add_argument("--kernels", default="cuda,tc", help="cuda: quant_gemv.py's; tc: quant_gemv_tc.py's; "
                    "packed: quant_gemv_packed.py's")
    args = ap.parse_args()
    kernels = args.kernels.split(",")
    assert kernels and set(kernels) <= {"cuda", "tc", "packed"}, args.kernels
    t0 = time.time()
    shapes = shapes_for(args.shape)
    fmts = args.formats.split(",")
    dev = device_name()
    ceil = ceilings()
    bw = ceil["copy_GBps"]
    grids = {"cuda": configs, "tc": tc_configs, "packed": pk_configs}
    # one compile per kernel variant: (kernel, format, prologue, residual, config)
    variants, jobs = {}, []
    for fmt in fmts:
        for spec in shapes.values():
            for kind in kernels:
                for c in grids[kind](fmt, args.quick):
                    key = (kind, fmt, spec[2], spec[3], c)
                    if key not in variants:
                        variants[key] = len(jobs)
                        jobs.append((fmt, spec, c, kind))
        for c in GEMM_CONFIGS if not args.no_gemm else ():       # one compile per format: no fusions
            variants[("gemm", fmt, c)] = len(jobs)
            jobs.append((fmt, next(iter(shapes.values())), c, "gemm"))
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
            tsp = [int4_to_words(t) for t in ts] if fmt == "int4" and "packed" in kernels else ts
            ref = quant_fused_linear_ref(x.float(), fmt, ts[0], (N, K), prologue=pro,
                                         norm_weight=None if nw is None else nw.float(), eps=1e-5,
                                         residual=None if r is None else r.float())
            wb = nbytes(ts[0])

            def measure(c, tc=False):
                tt = tsp if tc == "packed" else ts
                err = float((call(fmt, spec, x, tt[0], nw, r, c, tc).float() - ref).norm() / ref.norm())
                us = graph_us(lambda t: call(fmt, spec, x, t, nw, r, c, tc), tt)
                return dict(cfg=c, us=us, GBps=wb / us / 1e3, pct_copy=100 * wb / us / 1e3 / bw, rel_err=err)

            row = dict(format=fmt, shape=name, N=N, K=K, prologue=pro, residual=res, MB=wb / 1e6,
                       bf16_us=bf16_us, bf16_pct=100 * bf16_bytes / bf16_us / 1e3 / bw, floor_us=wb / bw / 1e3)
            for kind in kernels:
                tc = KIND_ARG[kind]
                sweep = [measure(c, tc) for c in grids[kind](fmt, args.quick)
                         if not errors.get((kind, fmt, pro, res, c)) and (kind != "packed" or c[3] == 1 or N <= 8192)]
                ok = sorted((s for s in sweep if s["rel_err"] < 1e-2), key=lambda d: d["us"])
                if not ok:
                    print(f"{kind} {fmt} {name}: no config passed ({sweep[:2]})", flush=True)
                    continue
                top = ok[0]
                table_cfg = {"tc": quant_gemv_tc_config, "cuda": quant_gemv_config,
                             "packed": quant_gemv_packed_config}[kind](fmt, 1, N, K)
                try:
                    table = measure(table_cfg, tc)
                except Exception as e:                          # e.g. a table entry past this GPU's shared memory
                    print(f"{kind} {fmt} {name}: table config {table_cfg} failed: {e}", flush=True)
                    table = dict(us=float("nan"), pct_copy=float("nan"))
                best[(kind, fmt, N, K)] = top["cfg"]
                sweeps[f"{kind}/{fmt}/{name}"] = ok[:10]
                row.update({f"{kind}_cfg": top["cfg"], f"{kind}_us": top["us"], f"{kind}_GBps": top["GBps"],
                            f"{kind}_pct": top["pct_copy"], f"{kind}_rel_err": top["rel_err"],
                            f"{kind}_table_cfg": table_cfg, f"{kind}_table_us": table["us"],
                            f"{kind}_table_pct": table["pct_copy"]})
                if kind == "packed":                            # each decode / early load at the best tiles
                    c, by = top["cfg"], {}
                    for fl in PK_FLAGS:
                        try:
                            m = top if fl == c[4] else measure((*c[:4], fl), "packed")
                            by[fl] = (m["us"], m["rel_err"])
                        except Exception as e:
                            by[fl] = (float("nan"), f"{type(e).__name__}: {str(e)[:80]}")
                    row["packed_us_err_by_flags"] = by
                elif not tc:
                    c = top["cfg"]
                    row["cuda_us_by_cvt"] = {v: (top if v == c[3] else measure((*c[:3], v, c[4])))["us"]
                                             for v in CVTS[fmt]}
                else:                                           # each dot dtype / decode at the best tiles
                    c, by_dot = top["cfg"], {}
                    for d in TC_DOTS[fmt]:
                        try:
                            m = top if d == c[4] else measure((*c[:4], d), True)
                            by_dot[d] = (m["us"], m["rel_err"])
                        except Exception as e:
                            by_dot[d] = (float("nan"), f"{type(e).__name__}: {str(e)[:80]}")
                    row["tc_us_err_by_dot"] = by_dot
            xk = x[:, :K].contiguous()                          # the GEMM's plain [1, K] input
            gref = quant_matmul_ref(xk.float(), fmt, ts[0], (N, K))
            gemm = []
            for gc in GEMM_CONFIGS if not args.no_gemm else ():
                if errors.get(("gemm", fmt, gc)):
                    continue
                gerr = float((quant_matmul(xk, fmt, ts[0], (N, K), config=gc).float() - gref).norm() / gref.norm())
                if gerr < 1e-2:
                    gemm.append((graph_us(lambda t, gc=gc: quant_matmul(xk, fmt, t, (N, K), config=gc), ts), gc))
            gemm_us, gemm_cfg = min(gemm) if gemm else (float("nan"), None)
            row.update(gemm_us=gemm_us, gemm_pct=100 * wb / gemm_us / 1e3 / bw, gemm_cfg=gemm_cfg)
            rows.append(row)
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            ts = tsp = None
            torch.cuda.empty_cache()
    layers = per_layer(rows, fmts, kernels)
    out = dict(device=dev, shape=args.shape, ceilings=ceil, kernels=kernels, rows=rows, per_layer=layers,
               sweeps=sweeps, best={f"{kd},{f},{n},{k}": c for (kd, f, n, k), c in best.items()},
               seconds=time.time() - t0)
    path = write_json(f"quant_gemv_{slug(dev)}_{args.shape}", out)
    print_report(dev, bw, args.shape, path, rows, layers, kernels, best)
    print(f"{time.time() - t0:.0f} s")


def print_report(dev, bw, shape, path, rows, layers, kernels, best) -> None:
    print(f"\n{dev}: copy {bw:.0f} GB/s; {shape} at M = 1; per call us (% of copy bandwidth, weight bytes "
          f"incl. scales); weights streamed from HBM; json: {path}")
    cols = [k for k in ("cuda", "tc", "packed") if k in kernels]
    print(f"{'fmt':5s} {'shape':8s} {'MB':>6s} {'floor':>6s} "
          + " ".join(f"{k + ' best':>15s} {'GB/s':>6s} {k + ' table':>15s}" for k in cols)
          + f" {'GEMM (tl.dot)':>15s} {'bf16 fused':>15s}  best cfgs")
    for r in rows:
        line = f"{r['format']:5s} {r['shape']:8s} {r['MB']:6.1f} {r['floor_us']:6.1f} "
        for k in cols:
            if f"{k}_us" in r:
                line += (f"{r[k + '_us']:7.1f} ({r[k + '_pct']:3.0f}%) {r[k + '_GBps']:6.0f} "
                         f"{r[k + '_table_us']:7.1f} ({r[k + '_table_pct']:3.0f}%) ")
            else:
                line += f"{'-':>15s} {'-':>6s} {'-':>15s} "
        line += " ".join(f"{r[k + '_us']:7.1f} ({r[k + '_pct']:3.0f}%)" for k in ("gemm", "bf16"))
        print(line + "  " + " ".join(f"{k}={r.get(k + '_cfg')}" for k in cols))
    print("\nper layer (qkv + o + gate_up + down), us and GB/s of weight bytes; x bf16: the bf16 fused layer's time "
          "over this one's")
    print(f"{'fmt':5s} {'kernel':10s} {'MB':>7s} {'floor':>7s} {'us':>8s} {'GB/s':>7s} {'% copy':>7s} {'x bf16':>7s}")
    for d in layers:
        print(f"{d['format']:5s} {d['kernel']:10s} {d['MB']:7.1f} {d['floor_us']:7.1f} {d['us']:8.1f} "
              f"{d['GBps']:7.0f} {d['pct_copy']:7.0f} {d['speedup_vs_bf16']:7.2f}")
    for kind, name, table in (("cuda", "quant_gemv.py", "QUANT_GEMV_CONFIGS"),
                              ("tc", "quant_gemv_tc.py", "QUANT_GEMV_TC_CONFIGS"),
                              ("packed", "quant_packed_configs.py", "QUANT_GEMV_PACKED_CONFIGS")):
        if kind in kernels:
            print(f"\n# paste into engine/kernels/{name} (merging entries of other shapes):")
            print(f"{table}.update({{")
            for (kd, f, n, k), c in best.items():
                if kd == kind:
                    print(f"    ({f!r}, {n}, {k}): {tuple(c)},")
            print("})")


KIND_ARG = {"cuda": False, "tc": True, "packed": "packed"}


def per_layer(rows: list[dict], fmts: list[str], kernels: list[str]) -> list[dict]:
    """Per format and kernel (best config, table config), the four projections summed: us, GB/s, % of copy."""
    out = []
    for fmt in fmts:
        rs = [r for r in rows if r["format"] == fmt]
        if not rs:
            continue
        mb, floor, bf16 = (sum(r[k] for r in rs) for k in ("MB", "floor_us", "bf16_us"))
        for kind in kernels:
            for label, key in ((f"{kind} best", f"{kind}_us"), (f"{kind} table", f"{kind}_table_us")):
                if all(key in r for r in rs):
                    us = sum(r[key] for r in rs)
                    out.append(dict(format=fmt, kernel=label, MB=mb, floor_us=floor, us=us, GBps=mb / us * 1e3,
                                    pct_copy=100 * floor / us, speedup_vs_bf16=bf16 / us))
    return out


if __name__ == "__main__":
    main()
