#!/usr/bin/env bash
# Issue 16 b1, the committed 1B down entry (persistent GEMV, PDL kept on) against the tiled rule, same H200 call;
# the 8B default; the GEMV variant kernel tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 60 python benchmarks/bench_gpu.py --shape llama-3.2-1b --sections latency \
  --latency-configs "cuda graphs,gemv_variant=tiled,1B before (4-launch sampler; no fused merge)" 2>&1 | tail -3
cp benchmarks/results/gpu_*llama-3.2-1b.json "$OUT/" 2>/dev/null
timeout 45 python benchmarks/bench_gpu.py --shape llama-3.1-8b --sections latency --latency-configs "cuda graphs" \
  2>&1 | tail -1
timeout 40 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py -k \
  "(fused_linear_variants and bfloat16 and persistent) or persistent_linears or switches" 2>&1 | tail -2
