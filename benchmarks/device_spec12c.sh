#!/usr/bin/env bash
# Issue 12, third round (spec12c: every-block shadow replays + confirm, prompt index prefetch), run from a copy of
# the branch in .wt/spec, in two `run` calls (kind nvidia-h200), right after each other while the machine is warm:
# Call 1: carry [".wt/spec", ".devbundle/part0", ".devbundle/pylib", ".devbundle/SHA256"];
#         command: bash .wt/spec/benchmarks/device_spec12c.sh dummy
# Call 2: carry [".wt/spec", ".devbundle/part1"];  command: bash .wt/spec/benchmarks/device_spec12c.sh bench
# The carried .devbundle parts sit at the checkout's root: main's device_bundle.py stashes them from there.
# Before = main's settings ('+main': every_block, confirm and prefetch off), after = the defaults, same engine.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../../.." && pwd)"
BR="$ROOT/.wt/spec"
OUT="${OUT:-/tmp/kvscope_out}"
mkdir -p "$OUT"
export TRITON_INTERPRET=0
cd "$ROOT" && python benchmarks/device_bundle.py stash
cd "$BR"
case "${1:-}" in
  dummy)
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 200 python -m pytest -q -x tests/test_gpu_engine.py -k spec -p no:cacheprovider 2>&1 | tail -4
    timeout 170 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --model dummy:llama-3.2-1b \
      --max-tokens 96 --reps 3 --methods none,ngram+main,ngram,ngram+noconfirm,ngram+noprefetch --modes b1,b8 \
      --workloads rewrite,chat --k-ngram 4 --max-num-seqs 16 --tag _llama1b_dummy_spec12c 2>&1 | grep -v '^{'
    cp benchmarks/results/spec_*_spec12c.json "$OUT"/ ;;
  bench)
    python benchmarks/device_bundle.py convert >/dev/null && echo converted
    timeout 250 python benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --reps 3 \
      --methods none,ngram+main,ngram,ngram+long,ngram+noconfirm,ngram+noeveryblock,ngram+main+long,ngram+noauto \
      --modes b1,b8 --workloads rewrite,chat --k-ngram 4 --k-long 8 --max-num-seqs 16 --tag _smollm2_spec12c \
      2>&1 | grep -v '^{'
    timeout 100 python benchmarks/spec_step_times.py --device cuda --dtype bfloat16 --max-tokens 128 --reps 3 \
      --methods none,ngram+main,ngram --modes b1,b8 --workloads rewrite,chat --tag _smollm2_spec12c 2>&1 | grep -v '^{'
    cp benchmarks/results/spec_*_spec12c.json "$OUT"/ ;;
  *) echo "usage: $0 {dummy|bench}" >&2; exit 2 ;;
esac
