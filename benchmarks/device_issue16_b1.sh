#!/usr/bin/env bash
# Issue 16, batch 1 at the Llama-3.2-1B shape (nvidia-h200), one `run` call over a copy of this tree: 1B and 8B
# batch-1 latency before/after (the one-launch sampler, the fused split merge), the GPU kernel tests of the
# changed kernels, the fp32 token identity under graphs, and a 1B decode profile.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
stamp latency1b
timeout 80 python benchmarks/bench_gpu.py --shape llama-3.2-1b --sections latency --latency-configs \
  "1B before (4-launch sampler; no fused merge),cuda graphs,decode_fused_merge=True" \
  2>&1 | grep -v Warn | tail -6
cp benchmarks/results/gpu_*llama-3.2-1b.json "$OUT/latency_1b.json" 2>/dev/null
stamp latency8b
timeout 75 python benchmarks/bench_gpu.py --shape llama-3.1-8b --sections latency --latency-configs \
  "cuda graphs,decode_fused_merge=True,sampler_one_launch=False" 2>&1 | grep -v Warn | tail -5
cp benchmarks/results/gpu_*llama-3.1-8b.json "$OUT/latency_8b.json" 2>/dev/null
stamp tests
timeout 50 python -m pytest -q -x -p no:cacheprovider tests/test_kernels_merge_sample.py tests/test_kernels.py tests/test_kernels_attention.py -k \
  "merge or one_launch or chunk or (decode_split and bfloat16) or decode_cuda_graph or padded_rows or gumbel \
  or switches" 2>&1 | tail -3
timeout 45 python -m pytest -q -x -p no:cacheprovider tests/test_gpu_engine.py -k \
  "triton_and_graphs_match_torch and float32" 2>&1 | tail -3
stamp profile
timeout 30 python benchmarks/profile_decode.py --pdl 0 2>&1 | grep -v -i warn | head -16
stamp done
