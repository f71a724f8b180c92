set -uo pipefail
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
B="python benchmarks/bench_gpu.py --shape llama-3.2-1b --sections latency"
echo "=== no table"; timeout 45 $B --latency-configs "cuda graphs" 2>&1 | tail -1
for t in gemv_table_1b_h200 gemv_table_1b_down_h200; do
  echo "=== $t"; timeout 60 $B --gemv-table benchmarks/results/$t.json \
    --latency-configs "cuda graphs,cuda graphs, enable_pdl=True" 2>&1 | tail -2
done
