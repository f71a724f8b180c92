#!/usr/bin/env bash
# The GPU suites, one entry point (on a CUDA machine; see benchmarks/gpu_env.sh for what an offline one needs):
#   benchmarks/gpu.sh                   list the suites
#   benchmarks/gpu.sh SUITE [ARGS...]   run one: it writes its JSON to benchmarks/results/ and prints a table
# ARGS go to the suite's script after the suite's own (argparse keeps the last of a repeated flag), except
# where a suite's line below says it takes shapes or test files first.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

SUITES=(tests kernels offline serving quant spec structured tp kv lessons)
declare -A ABOUT=(
  [tests]="[tests/FILE...] [pytest args]  the GPU tests: test_gpu_*.py, the kernel tests at full size, the bf16 masks"
  [kernels]="[SHAPE...] [args]  bench_kernels.py: every Triton kernel against torch and the copy / matmul ceilings"
  [offline]="[SHAPE...] [args]  bench_gpu.py: batch 1, nano-vllm's workload, prefill-heavy; vLLM beside"
  [serving]="[args]  bench_serve.py --suite serving: vLLM's server, kvscope's server and LLM.generate, same requests"
  [quant]="[args]  bench_quant.py: fp8 / int8 / int4 GEMV and GEMM per projection; the 8B shape per format"
  [spec]="[args]  bench_spec.py: n-gram and self drafting, batch 1 and 8; dummy Llama-3.2-1B, bundled SmolLM2"
  [structured]="[args]  bench_structured.py: JSON-schema decoding against free decoding, multi-step and single steps"
  [tp]="[args]  2+ GPUs: test_gpu_tp.py, bench_tp.py (8B latency + throughput at TP 1 / 2, vLLM TP=2; args go to it), DP 1 / 2 serving burst (vLLM DP=2 beside)"
  [kv]="[args]  KV tiers: bench_kv_tiers.py (fp8 capacity, multi-turn with/without the host tier, swap vs recompute; 1B shape), the 8B long-context workload with fp8 KV against vLLM's (args go to bench_kv_tiers.py)"
  [lessons]="[args]  lessons.py on the Llama-3.2-1B shape, large sweeps and the CUDA-graph timing cost"
)
OFFLINE_SHAPES=(llama-3.2-1b llama-3.1-8b qwen3-0.6b)
KERNEL_SHAPES=(llama-3.2-1b llama-3.1-8b)

usage() {
  echo "usage: benchmarks/gpu.sh SUITE [ARGS...]"
  for s in "${SUITES[@]}"; do printf "  %-11s %s\n" "$s" "${ABOUT[$s]}"; done
}

# leading arguments that are not flags -> SHAPES, the rest -> REST
split_shapes() {
  SHAPES=(); REST=()
  while [ $# -gt 0 ] && [[ $1 != -* ]]; do SHAPES+=("$1"); shift; done
  REST=("$@")
}

suite_tests() {
  local files=() args=()
  for a in "$@"; do if [[ $a == tests/* ]]; then files+=("$a"); else args+=("$a"); fi; done
  [ ${#files[@]} -gt 0 ] || files=(tests/test_gpu_*.py tests/test_kernels.py tests/test_kernels_attention.py
                                   tests/test_kernels_merge_sample.py tests/test_structured_mask.py tests/test_kv_fp8.py
                                   tests/test_logit_bias.py tests/test_prompt_logprobs.py tests/test_fault_isolation.py)
  install_tokenizer
  # Triton compiles dominate on a fresh machine and run on the CPU: spread the tests over 8 processes (one GPU
  # holds them all) when pytest-xdist is there, a file per process except the cases marked `spread`
  local par=(-o addopts=)                      # pyproject's two processes are the CPU suite's
  python3 -c "import xdist" 2>/dev/null && par=(-n 8 --dist loadgroup)
  python3 -m pytest -q -p no:cacheprovider -p benchmarks.pytest_record "${par[@]}" "${files[@]}" "${args[@]}"
}

suite_kernels() {
  split_shapes "$@"
  [ ${#SHAPES[@]} -gt 0 ] || SHAPES=("${KERNEL_SHAPES[@]}")
  for shape in "${SHAPES[@]}"; do
    stamp "bench_kernels $shape"
    python3 benchmarks/bench_kernels.py --sweep --shape "$shape" "${REST[@]}"
  done
}

suite_offline() {
  split_shapes "$@"
  [ ${#SHAPES[@]} -gt 0 ] || SHAPES=("${OFFLINE_SHAPES[@]}")
  local sections=latency,throughput,prefill
  if have_vllm; then sections=vllm,$sections; else echo "no vLLM in $VLLM_SITE: kvscope rows only"; fi
  for shape in "${SHAPES[@]}"; do
    stamp "bench_gpu $shape"
    python3 benchmarks/bench_gpu.py --shape "$shape" --sections "$sections" --hf-requests 0 \
      --latency-configs "cuda graphs" --vllm-path "$VLLM_SITE" "${REST[@]}"
  done
}

# vLLM's OpenAI server on the Llama-3.2-1B shape (dummy weights, token-id prompts) at port 8002; $1: max model length
vllm_server_cmd() {
  local cfg; cfg=$(mktemp -d)
  python3 -c "from pathlib import Path; from benchmarks.vllm_offline import write_config; \
write_config('llama-3.2-1b', Path('$cfg'))"
  echo "PYTHONPATH=$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH} python3 -m vllm.entrypoints.openai.api_server --model $cfg \
--load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len $1 --served-model-name llama1b --port 8002"
}

suite_serving() {
  have_vllm || { echo "serving: no vLLM in $VLLM_SITE"; return 3; }
  local vllm; vllm=$(vllm_server_cmd 4096)
  # every server workload from one client process and from four (a single Python client falls behind in the
  # burst, and its own delays would count as the server's)
  python3 benchmarks/bench_serve.py --suite serving --model dummy:llama-3.2-1b --device cuda \
    --server-arg=--max-model-len=4096 --server-arg=--skip-tokenizer-init --launch "vllm=$vllm" --target vllm=http://127.0.0.1:8002 \
    --target kvscope=launch --target offline=offline --client-procs 1,4 --name "serving_suite_$(device_slug)" "$@"
}

suite_quant() {
  python3 benchmarks/bench_quant.py "$@"
}

suite_spec() {
  local common=(--device cuda --dtype bfloat16 --reps 3 --modes b1,b8 --workloads rewrite,chat --k-ngram 4
                --k-long 8 --k-self 2 --max-num-seqs 16)
  stamp "random Llama-3.2-1B-shaped weights: acceptance ~0, so these rows are what drafting costs"
  python3 benchmarks/bench_spec.py "${common[@]}" --model dummy:llama-3.2-1b --max-tokens 96 \
    --methods none,ngram,ngram+long,self --self-layers 8 --tag _llama1b_dummy "$@"
  stamp "the bundled SmolLM2: real text"
  if python3 benchmarks/device_bundle.py ensure; then
    python3 benchmarks/bench_spec.py "${common[@]}" --max-tokens 128 \
      --methods none,ngram,ngram+long,ngram+noauto,self --self-layers 24 --tag _smollm2 "$@"
  else
    echo "spec: no bundled SmolLM2 here (benchmarks/device_bundle.py): its rows skipped"
  fi
}

suite_structured() {
  install_tokenizer
  for k in 8 1; do
    stamp "bench_structured, num_scheduler_steps $k"
    python3 benchmarks/bench_structured.py --model dummy:llama-3.2-1b --batch-sizes 1 32 --num-scheduler-steps "$k" "$@"
  done
}

suite_tp() {
  local n rc=0; n=$(nvidia-smi -L | wc -l)
  [ "$n" -ge 2 ] || { echo "tp: needs 2 or more GPUs, this machine has $n"; return 3; }
  install_tokenizer
  python3 benchmarks/device_bundle.py ensure || echo "tp: no bundled SmolLM2 here: its TP test skips"
  stamp "tensor-parallel GPU tests: fp32 greedy identity TP=1 vs TP=2 (Llama-3.2-1B shape, bundled SmolLM2)"
  python3 -m pytest -q -o addopts= -p no:cacheprovider -p benchmarks.pytest_record tests/test_gpu_tp.py || rc=1   # one at a time: each test takes both GPUs
  stamp "bench_tp: Llama-3.1-8B shape, batch-1 latency and nano throughput, TP=1 vs TP=2"
  local sections=latency,throughput; have_vllm && sections=$sections,vllm
  python3 benchmarks/bench_tp.py --sections "$sections" --requests 128 --vllm-path "$VLLM_SITE" "$@" || rc=1
  stamp "serving burst, Llama-3.2-1B shape: one engine vs --data-parallel-size 2 (four API servers, the default, and one), vLLM's beside"
  local peer=()
  if have_vllm; then
    peer=(--launch "vllm-dp2=$(vllm_server_cmd 2048) --data-parallel-size 2" --target vllm-dp2=http://127.0.0.1:8002)
  fi
  python3 benchmarks/bench_serve.py --model dummy:llama-3.2-1b --device cuda --request-rate inf \
    --num-prompts 512 --input-len 512 --output-len 128 --server-arg=--max-model-len=2048 \
    --server-arg=--skip-tokenizer-init --client-procs 4 --repeats 3 \
    --target dp1=launch --target dp2=launch:--data-parallel-size=2 \
    --target dp2-api1=launch:--data-parallel-size=2,--api-server-count=1 "${peer[@]}" \
    --name "dp_burst_$(device_slug)" || rc=1
  stamp "the same burst at 2,048 prompts: one engine vs --data-parallel-size 2, vLLM's beside (the clients' start weighs a quarter as much)"
  python3 benchmarks/bench_serve.py --model dummy:llama-3.2-1b --device cuda --request-rate inf \
    --num-prompts 2048 --input-len 512 --output-len 128 --server-arg=--max-model-len=2048 \
    --server-arg=--skip-tokenizer-init --client-procs 4 --repeats 2 \
    --target dp1=launch --target dp2=launch:--data-parallel-size=2 "${peer[@]}" \
    --name "dp_burst_2048_$(device_slug)" || rc=1
  return $rc
}

suite_kv() {
  local rc=0
  stamp "bench_kv_tiers, Llama-3.2-1B shape"
  python3 benchmarks/bench_kv_tiers.py --model dummy:llama-3.2-1b --device cuda "$@" || rc=1
  stamp "8B long contexts: bf16 and fp8 KV, vLLM's fp8 KV beside"
  local sections=longctx; have_vllm && sections=vllm,$sections
  python3 benchmarks/bench_gpu.py --shape llama-3.1-8b --sections "$sections" --vllm-kv-cache-dtypes fp8 \
    --long-requests 200 --hf-requests 0 --tag longctx --vllm-path "$VLLM_SITE" || rc=1
  return $rc
}

suite_lessons() {
  python3 benchmarks/lessons.py --model dummy:llama-3.2-1b \
    --lessons paging,kv_cache,batching,batch_sweep,chunked_prefill,graph_timing "$@"
}

suite="${1:-}"
if [ -z "$suite" ] || [ -z "${ABOUT[$suite]+x}" ]; then
  [ -n "$suite" ] && [[ $suite != -h && $suite != --help ]] && echo "unknown suite: $suite"
  usage
  [ -z "$suite" ] || [[ $suite == -h || $suite == --help ]]
  exit $?
fi
shift
gpu_info
stamp "$suite"
"suite_$suite" "$@"
rc=$?
stamp "$suite done (exit $rc)"
exit $rc
