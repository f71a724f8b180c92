#!/usr/bin/env bash
# On a CUDA machine: the kernel tests at full size with compiled Triton (not the interpreter), then the
# benchmark. Logs and the JSON go under $OUT (default /tmp/kvscope_gpu) and benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/kvscope_gpu} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee "$OUT/smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider $xdist tests/test_kernels.py tests/test_kernels_attention.py 2>&1 | tee "$OUT/pytest.log"
timeout "${BENCH_TIMEOUT:-270}" python3 benchmarks/bench_kernels.py ${BENCH_ARGS:---sweep} 2>&1 | tee "$OUT/bench.log"
