#!/usr/bin/env bash
# Issue 13 on a CUDA machine: the structured-output GPU tests with compiled Triton, then the cost benchmark
# (dummy:llama-3.2-1b, bf16) against single steps and against multi-step blocks, and with the torch mask.
#
# A bare device machine has neither llguidance nor SmolLM2's tokenizer. Here, once (ignored .whl/, ~11 MiB):
#   SP=$(python -c "import llguidance, os; print(os.path.dirname(os.path.dirname(llguidance.__file__)))")
#   mkdir -p .whl/pylib .whl/tok && cp -r $SP/llguidance $SP/llguidance-*.dist-info .whl/pylib/
#   cp ~/.cache/kvscope/smollm2-135m-instruct/{tokenizer.json,tokenizer_config.json,*.jinja,*config.json} .whl/tok/
# Call (kind nvidia-h200; carry [".whl"]):   bash benchmarks/device_structured.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvscope_out}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
[ -d .whl/pylib ] && export PYTHONPATH="$PWD/.whl/pylib${PYTHONPATH:+:$PYTHONPATH}"
TOK=(); [ -d .whl/tok ] && TOK=(--tokenizer-dir .whl/tok)
python -c "from benchmarks.bench_structured import install_tokenizer; from pathlib import Path; install_tokenizer(Path('.whl/tok'))" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
case "${1:-all}" in
  tests|all)
    timeout 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_structured.py tests/test_structured_mask.py 2>&1 | tail -15 ;;&
  bench|all)
    B=(--model dummy:llama-3.2-1b --batch-sizes 1 32 "${TOK[@]}")
    for args in "--num-scheduler-steps 8" "--num-scheduler-steps 1" "--num-scheduler-steps 8 --structured-multi-step off" \
                "--num-scheduler-steps 8 --structured-overlap off"; do
      echo "== bench_structured $args"
      timeout 240 python benchmarks/bench_structured.py "${B[@]}" $args 2>&1 | grep -v "^{" | tail -8
    done
    cp benchmarks/results/structured_nvidia-*.json "$OUT"/ 2>/dev/null || true ;;
esac
