#!/usr/bin/env bash
# One `run` call: the q/k-norm and decode-attention GPU tests, Qwen3-0.6B prefill-heavy and nano with
# fused_qk_norm on / off, and the decode-attention launch sweep at the Qwen3 and Llama-3.1-8B heads.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
stamp tests
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py -k "head_rms_norm or decode_split" 2>&1 | tail -2
stamp qwen3
timeout 200 python benchmarks/bench_gpu.py --shape qwen3-0.6b --sections throughput,prefill,ablation --hf-requests 0 \
  --ablations "fused_qk_norm=False" --prefill-ablations "fused_qk_norm=False" 2>&1 | grep -v "Warn\|warn" | tail -8
cp benchmarks/results/gpu_*qwen3-0.6b.json "$OUT"/qwen3_qknorm.json 2>/dev/null
for shape in ${SWEEP_SHAPES:-qwen3-0.6b llama-3.1-8b}; do
  stamp "sweep $shape"
  timeout 150 python benchmarks/sweep_decode_attention.py --shape "$shape" 2>&1 | grep -v "Warn\|warn" | tail -12
done
cp benchmarks/results/sweep_decode_*.json "$OUT"/ 2>/dev/null
stamp done
