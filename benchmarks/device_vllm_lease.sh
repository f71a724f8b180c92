#!/usr/bin/env bash
# kvscope beside vLLM 0.26.0 in one lease (issues 14 and 16): after the peer's three setup calls
# (../shared/vllm-peer/README.md), one `run` call per phase, each well under the 600 s call limit:
#   bash benchmarks/device_vllm_lease.sh table <shape>     bench_gpu.py: batch 1, nano, prefill-heavy, vLLM beside
#   bash benchmarks/device_vllm_lease.sh profile <shape> <workload>   profile_kernels.py for both engines
#   bash benchmarks/device_vllm_lease.sh fp8                nano workload, 8B shape, fp8 weights, both engines
#   bash benchmarks/device_vllm_lease.sh check              the attention GPU tests, fp32 token identity under graphs
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
VSITE="$HOME/vsite"
[ -d "$VSITE" ] || [ "${1:-}" = check ] || { echo "no $VSITE: run the peer's setup calls first"; exit 3; }
case "${1:-}" in
  table)
    stamp "table ${2}"
    timeout 560 python benchmarks/bench_gpu.py --shape "$2" --sections vllm,latency,throughput,prefill \
      --hf-requests 0 --latency-configs "cuda graphs" --vllm-path "$VSITE" 2>&1 | grep -v "^\[\|Warn\|warn" | tail -25
    cp benchmarks/results/gpu_*"$2".json "$OUT"/ 2>/dev/null ;;
  profile)
    stamp "kvscope ${2} ${3}"
    timeout 200 python benchmarks/profile_kernels.py --engine kvscope --shape "$2" --workload "$3" 2>&1 | tail -32
    stamp "vllm ${2} ${3}"
    PYTHONPATH="$VSITE" timeout 330 python benchmarks/profile_kernels.py --engine vllm --shape "$2" --workload "$3" \
      2>&1 | grep -v "^\(INFO\|WARNING\|DEBUG\)" | tail -32 ;;
  fp8)
    stamp "kvscope fp8"
    timeout 200 python benchmarks/profile_kernels.py --engine kvscope --shape llama-3.1-8b --workload nano \
      --quantization fp8 2>&1 | tail -14
    stamp "vllm fp8"
    PYTHONPATH="$VSITE" timeout 330 python benchmarks/profile_kernels.py --engine vllm --shape llama-3.1-8b \
      --workload nano --quantization fp8 2>&1 | grep -v "^\(INFO\|WARNING\|DEBUG\)" | tail -14 ;;
  check)
    stamp "GPU tests"
    timeout 100 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py -k "head_rms_norm or decode or paged" 2>&1 | tail -2
    timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py -k "triton_and_graphs_match_torch and float32" \
      2>&1 | tail -2 ;;
  *) echo "usage: $0 table <shape> | profile <shape> <nano|prefill> | fp8 | check"; exit 2 ;;
esac
stamp done
cp benchmarks/results/kernels_profile_*.json "$OUT"/ 2>/dev/null
true
