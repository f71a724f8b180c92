"""The CPU int4 GEMM alone: kvscope::int4_linear's C++ kernel against torch's CPU int4 GEMM
(aten._weight_int4pack_mm_for_cpu, bf16 activations) on the bundled SmolLM2-135M's linear shapes (groups of 32),
for decode-sized and prefill-sized M. Median µs a call, and a forward's sum (30 layers x 4 projections + the LM
head). Prints a table, writes benchmarks/results/cpu_int4_gemm.json.

    python benchmarks/bench_cpu_int4.py [--m 1 8 64 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, write_json  # noqa: E402
from engine.kernels import cpu_kernels  # noqa: E402
from engine.quant import formats  # noqa: E402

# (N, K, calls a forward): q|k|v, o, gate|up, down (30 layers each), the LM head
SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def median_us(f, n: int) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 256], help="activation rows")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the C++ CPU kernels could not be built")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for M in args.m:
            total = {"kvscope": 0.0, "torch": 0.0}
            for N, K, calls in SHAPES:
                t = formats.quantize(torch.randn(N, K) * 0.02, "int4", 32)
                codes = formats.int4_codes(t).to(torch.int32).contiguous()
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
                s, m = t["scales"].float(), t["mins"].float()
                sz = torch.stack((s, m + 8 * s), dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)
                x = torch.randn(M, K)
                n = max(5, min(200, int(3e7 / (N * K * M))))
                ours = median_us(lambda: torch.ops.kvscope.int4_linear(x, t["qweight"], t["scales"], t["mins"], 32),
                                 n)
                theirs = median_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.to(torch.bfloat16), packed, 32, sz).float(), n)
                total["kvscope"] += ours * calls
                total["torch"] += theirs * calls
                rows.append(dict(M=M, N=N, K=K, kvscope_us=ours, torch_us=theirs, speedup=theirs / ours))
            rows.append(dict(M=M, N="forward", K="", kvscope_us=total["kvscope"], torch_us=total["torch"],
                             speedup=total["torch"] / total["kvscope"]))
    print_table(rows, ["M", "N", "K", "kvscope_us", "torch_us", "speedup"])
    path = write_json("cpu_int4_gemm", dict(device=device_name("cpu"), threads=args.threads, rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
