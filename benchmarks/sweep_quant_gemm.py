"""GPU: the FP8 w8a8 GEMM above the decode GEMV (the nano workload's batches), per 8B projection and batch rows M:
bf16 cuBLAS (F.linear on the unquantized weight), the two-launch path (kernels/quant_gemm_fp8.py:
per-token-group quantization, then the Triton FP8 GEMM at the rule's config and at each swept config) and cuBLAS's
block-wise scaled_mm where torch has it. Every output is checked against quant_matmul_ref (activations
round-tripped through fp8) first.
Timings: triton.testing.do_bench (L2 cleared before each call), microseconds.

    python benchmarks/sweep_quant_gemm.py [--shape llama-3.1-8b] [--ms 32,64,128,256] [--quick]

Prints a table and the best config per M; JSON to benchmarks/results/quant_gemm_<device>_<shape>.json.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from benchmarks.sweep_gemv import shapes_for  # noqa: E402
from engine.kernels.quant_gemm import quant_matmul_ref  # noqa: E402
from engine.kernels.quant_gemm_fp8 import (cublas_supported, gemm_fp8, gemm_fp8_config, gemm_fp8_cublas,  # noqa: E402
                                           quantize_activations_fp8)
from engine.quant.formats import quantize  # noqa: E402


def _us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def configs(M: int, quick: bool) -> list[tuple[int, int, int, int]]:
    bms = [b for b in (16, 32, 64, 128) if b <= max(16, 2 * M)]
    bns = (64, 128) if quick else (64, 128, 256)
    return [c for c in itertools.product(bms, bns, (4, 8), (3, 4, 5) if not quick else (4,))
            if not (c[0] == 128 and c[1] == 256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ms", default="32,64,128,256")
    ap.add_argument("--quick", action="store_true", help="fewer configs (BLOCK_N 64/128, 4 stages)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows, best_by_m = [], {}
    for name, (N, K, *_) in shapes_for(args.shape).items():
        w = torch.randn(N, K, device="cuda") * 0.02
        t = quantize(w, "fp8")
        wb = w.to(torch.bfloat16)
        del w
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = quant_matmul_ref(x, "fp8", t, (N, K), act_fp8=True)
            q, s = quantize_activations_fp8(x)
            row = dict(proj=name, N=N, K=K, M=M)
            row["bf16_us"] = _us(lambda: torch.nn.functional.linear(x, wb))
            row["act_quant_us"] = _us(lambda: quantize_activations_fp8(x))
            row["triton_err"] = _rel(gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], x.dtype), ref)
            row["triton_us"] = _us(lambda: gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], x.dtype))
            best = (float("inf"), None)
            for cfg in configs(M, args.quick):
                try:
                    y = gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], x.dtype, config=cfg)
                    if _rel(y, ref) > 1e-2:
                        print(f"  {name} M={M} {cfg}: wrong (rel {_rel(y, ref):.3g})", flush=True)
                        continue
                    us = _us(lambda: gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], x.dtype, config=cfg))
                except Exception as e:          # out of shared memory etc.
                    print(f"  {name} M={M} {cfg}: {type(e).__name__}", flush=True)
                    continue
                best = min(best, (us, cfg))
                best_by_m.setdefault(M, {}).setdefault(cfg, []).append(us)
            row["triton_best_us"], row["triton_best_cfg"] = best[0], str(best[1])
            if cublas_supported(N, K):
                try:
                    row["cublas_err"] = _rel(gemm_fp8_cublas(q, s, t["weight"], t["weight_scale_inv"], x.dtype), ref)
                    row["cublas_us"] = _us(lambda: gemm_fp8_cublas(q, s, t["weight"], t["weight_scale_inv"],
                                                                   x.dtype))
                except Exception as e:
                    row["cublas_us"] = f"{type(e).__name__}: {e}"[:80]
            rows.append(row)
            print(row, flush=True)
        del t, wb
        torch.cuda.empty_cache()
    # the config with the least summed time over the projections, per M (what gemm_fp8_config should pick)
    summary = []
    for M, per in sorted(best_by_m.items()):
        full = {c: v for c, v in per.items() if len(v) == len(shapes_for(args.shape))}
        if full:
            c, v = min(full.items(), key=lambda kv: sum(kv[1]))
            summary.append(dict(M=M, best_config=str(c), sum_us=sum(v), rule=str(gemm_fp8_config(M)),
                                rule_sum_us=sum(full.get(gemm_fp8_config(M), [float("nan")]))))
    dev = device_name()
    path = write_json(f"quant_gemm_{slug(dev)}_{args.shape}", dict(device=dev, torch=torch.__version__,
                                                                   cuda=torch.version.cuda, rows=rows,
                                                                   summary=summary))
    print(f"\ndevice: {dev}; torch {torch.__version__} (CUDA {torch.version.cuda}); json: {path}")
    print_table(rows, ["proj", "M", "bf16_us", "act_quant_us", "triton_us", "triton_best_us",
                       "triton_best_cfg", "cublas_us", "triton_err", "cublas_err"])
    print()
    print_table(summary, ["M", "best_config", "sum_us", "rule", "rule_sum_us"])


if __name__ == "__main__":
    main()
