#!/usr/bin/env bash
# Issue 12 on the device: spec-decoding GPU tests, then the real-weight benchmark, in two `run` calls.
#
# Here, once:   python benchmarks/device_bundle.py split      (writes the ignored .devbundle/: 2 x 47 MiB + 0.6 MiB)
#
# Call 1 (kind nvidia-h200; carry [".devbundle/part0", ".devbundle/pylib", ".devbundle/SHA256"]):
#   bash benchmarks/device_spec.sh tests
# Call 2 (same kind, right after, while the machine is warm; carry [".devbundle/part1"]):
#   bash benchmarks/device_spec.sh bench
# If call 2 says a part is missing (the machine went cold), run call 1's carry again with `bash
# benchmarks/device_spec.sh stash` and then call 2.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kvscope_out}"
mkdir -p "$OUT"
case "${1:-}" in
  stash)
    python benchmarks/device_bundle.py stash ;;
  tests)
    python benchmarks/device_bundle.py stash
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    # conftest defaults TRITON_INTERPRET to 1 (CPU CI): compiled kernels here
    TRITON_INTERPRET=0 timeout 500 python -m pytest -q -x tests/test_gpu_engine.py -p no:cacheprovider 2>&1 | tail -25 ;;
  bench)
    python benchmarks/device_bundle.py stash convert
    # real weights: plain vs n-gram (fast verify path, and the general one: ngram+general) vs self-speculative,
    # rewrite and chat, batch 1 and 8, auto-off on (default)
    timeout 330 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --reps 2 \
      --methods none,ngram,ngram+general,self --modes b1,b8 --workloads rewrite,chat --k-ngram 4 --k-self 2 --self-layers 24 \
      --max-num-seqs 16 --tag _smollm2 2>&1 | grep -v '^{' || true
    # cost only: random Llama-3.2-1B-shaped weights (acceptance ~ 0), auto-off must hold >= 0.97x
    timeout 200 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --model dummy:llama-3.2-1b \
      --max-tokens 96 --reps 2 --methods none,ngram,ngram+general,self --modes b1,b8 --workloads rewrite,chat \
      --k-ngram 4 --k-self 2 --self-layers 8 --max-num-seqs 16 --tag _llama1b_dummy 2>&1 | grep -v '^{' || true
    cp benchmarks/results/spec_*_smollm2.json benchmarks/results/spec_*_llama1b_dummy.json "$OUT"/ 2>/dev/null || true ;;
  # issue 12, second round (shadow probes, long drafts), two calls: call 1 carries part0, pylib, SHA256
  # (`dummy`: stash, the spec GPU tests, the Llama-3.2-1B-shape cost rows); call 2 carries part1 (`bench2`)
  dummy)
    python benchmarks/device_bundle.py stash
    TRITON_INTERPRET=0 timeout 150 python -m pytest -q -x tests/test_gpu_engine.py -k spec -p no:cacheprovider 2>&1 | tail -6 || true
    timeout 200 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --model dummy:llama-3.2-1b \
      --max-tokens 96 --reps 3 --methods none,ngram,ngram+noshadow --modes b1,b8 --workloads rewrite,chat \
      --k-ngram 4 --max-num-seqs 16 --tag _llama1b_dummy 2>&1 | grep -v '^{' || true ;;
  bench2)
    python benchmarks/device_bundle.py stash convert
    timeout 330 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --reps 3 \
      --methods none,ngram,ngram+long,ngram+noshadow --modes b1,b8 --workloads rewrite,chat --k-ngram 4 --k-long 8 \
      --max-num-seqs 16 --tag _smollm2 2>&1 | grep -v '^{' || true ;;
  *)
    echo "usage: $0 {tests|bench|stash|dummy|bench2}" >&2; exit 2 ;;
esac
