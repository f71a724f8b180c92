#!/usr/bin/env bash
# Issue 16, batch-1 decode kernels on the device (nvidia-h200), in two `run` calls over a copy of this tree:
#   call 1: bash benchmarks/device_issue16.sh sweep    GPU kernel tests; sweep_gemv.py on the 8B shapes (+ the
#           q/k/v-RoPE kernel) writing $OUT/table_8b.json; the 8B batch-1 latency with that table
#           (--gemv-table) and with the previous kernels; profile_decode.py --pdl 0 with the table
#   call 2: bash benchmarks/device_issue16.sh confirm  the committed tables: 8B and 1B batch 1, the fp32
#           token-identity GPU tests
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
case "${1:-}" in
  sweep)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    stamp tests
    timeout 50 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py -k "(decode_split and bfloat16) \
      or decode_cuda_graph or padded_rows or (fused_linear_variants and bfloat16 and (persistent or tiled)) \
      or (fused_qkv_rope_store and bfloat16 and config0)" 2>&1 | tail -8
    stamp sweep
    timeout 120 python benchmarks/sweep_gemv.py --shape llama-3.1-8b --ms 1 --rep 25 --qkv-rope \
      --table-out "$OUT/table_8b.json" 2>&1 | grep -v "^{" | tail -40
    TABLE=""
    [ -s "$OUT/table_8b.json" ] && TABLE="$OUT/table_8b.json"
    stamp latency
    timeout 75 python benchmarks/bench_gpu.py --gemv-table "$TABLE" --shape llama-3.1-8b --sections latency \
      --latency-configs "cuda graphs" 2>&1 | tail -6
    cp benchmarks/results/gpu_*llama-3.1-8b.json "$OUT/latency_8b_new.json" 2>/dev/null
    stamp profile
    timeout 60 python benchmarks/profile_decode.py --gemv-table "$TABLE" --shape llama-3.1-8b --pdl 0 \
      2>&1 | grep -v Warn | head -14
    stamp previous
    timeout 60 python benchmarks/bench_gpu.py --shape llama-3.1-8b --sections latency \
      --latency-configs "previous kernels (tiled; no fused merge)" 2>&1 | tail -4
    stamp done ;;
  confirm)
    nvidia-smi --query-gpu=name --format=csv
    stamp sweep1b
    timeout 75 python benchmarks/sweep_gemv.py --shape llama-3.2-1b --ms 1 --rep 25 --qkv-rope \
      --table-out "$OUT/table_1b.json" 2>&1 | grep -v "^{" | grep -v "best \[" | tail -14
    TABLE=""
    [ -s "$OUT/table_1b.json" ] && TABLE="$OUT/table_1b.json"
    stamp latency1b
    timeout 60 python benchmarks/bench_gpu.py --gemv-table "$TABLE" --shape llama-3.2-1b --sections latency \
      --latency-configs "cuda graphs,previous kernels (tiled; no fused merge)" 2>&1 | tail -4
    cp benchmarks/results/gpu_*llama-3.2-1b.json "$OUT/latency_1b.json" 2>/dev/null
    stamp latency8b
    timeout 95 python benchmarks/bench_gpu.py --shape llama-3.1-8b --sections latency --latency-configs \
      "cuda graphs,cuda graphs, enable_pdl=False,decode_fused_merge=False,previous kernels (tiled; no fused merge)" \
      2>&1 | tail -6
    cp benchmarks/results/gpu_*llama-3.1-8b.json "$OUT/latency_8b.json" 2>/dev/null
    stamp tests
    timeout 60 python -m pytest -q -x -p no:cacheprovider tests/test_gpu_engine.py -k "triton_and_graphs_match_torch and float32" \
      2>&1 | tail -4
    timeout 30 python -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py -k "(decode_split and bfloat16) or decode_cuda_graph or switches" \
      2>&1 | tail -4
    stamp profile
    timeout 35 python benchmarks/profile_decode.py --shape llama-3.1-8b --pdl 0 2>&1 | grep -v Warn | head -9
    stamp done ;;
  *) echo "usage: $0 sweep|confirm"; exit 2 ;;
esac
