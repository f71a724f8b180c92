#!/usr/bin/env bash
# kvscope's server against vLLM 0.26.0's on one GPU, one server at a time, with two clients: bench_serve.py's thin
# aiohttp client and the official `openai` client (AsyncOpenAI, what applications use), 4 client processes each.
# Every part fits one ~10-minute call; each prints the side-by-side table and writes
# benchmarks/results/serve_serving_suite_<part>_<targets>_<device>.json.
#
#   bash benchmarks/serving_suite.sh PART [bench_serve.py args...]
#     1b      dummy Llama-3.2-1B weights: 512 prompts at once, and 400 at 24 req/s (input 512 / output 256 ±50%)
#     8b      the same at the Llama-3.1-8B shape
#     70b     the Llama-3.1-70B shape at TP=2 on both servers (2 GPUs): 256 prompts at once, and 200 at 4 req/s
#     text    the bundled SmolLM2 (real weights): 256 text chat prompts at once, and 64 four-turn chats behind one
#             shared 512-token system prompt (prefix-cache heavy)
#     client  no engine: the openai client against a server that streams every chunk at once (its own cost)
#   TARGETS=vllm,kvscope (default) picks the servers, in order; also kvscope-s256 (max_num_seqs 256, the old
#   default), kvscope-ms50 (multi-step blocks up to 50 ms; the server's default is 4 ms), kvscope-api1 (one API
#   server process; on a GPU the default is 4), kvscope-api4 (4, set explicitly), kvscope-si4 (--stream-interval 4:
#   a chunk waits for 4 new tokens), kvscope-si<T>ms (--stream-interval-ms T: a stream's chunks at least T ms
#   apart, e.g. kvscope-si10ms; kvscope-siautoms: the wait by the API server's open streams), and null: no engine, each
#   stream's first chunk at once and the rest at the cadence of the target before it, so that the side-by-side
#   table sets every server's /metrics TTFT against the client's less the client's own (TARGETS=vllm,kvscope,null).
#   Split a part that runs long by TARGETS.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

TARGETS="${TARGETS:-vllm,kvscope}"
VLLM_PORT=8002

vllm_cmd() {    # vllm_cmd MODEL_FOLDER EXTRA_ARGS...
  local folder=$1; shift
  echo "PYTHONPATH=$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH} python3 -m vllm.entrypoints.openai.api_server \
--model $folder --dtype bfloat16 --port $VLLM_PORT $*"
}

# target_args VLLM_COMMAND -> TARGET_ARGS (bench_serve.py --target / --launch flags for $TARGETS)
target_args() {
  TARGET_ARGS=()
  local t
  for t in ${TARGETS//,/ }; do
    case $t in
      vllm)
        have_vllm || { echo "no vLLM in $VLLM_SITE: vllm skipped"; continue; }
        TARGET_ARGS+=(--launch "vllm=$1" --target "vllm=http://127.0.0.1:$VLLM_PORT") ;;
      kvscope) TARGET_ARGS+=(--target kvscope=launch) ;;
      kvscope-s256) TARGET_ARGS+=(--target kvscope-s256=launch:--max-num-seqs=256) ;;
      kvscope-ms50) TARGET_ARGS+=(--target kvscope-ms50=launch:--multi-step-max-ms=50) ;;
      kvscope-api1) TARGET_ARGS+=(--target kvscope-api1=launch:--api-server-count=1) ;;
      kvscope-api4) TARGET_ARGS+=(--target kvscope-api4=launch:--api-server-count=4) ;;
      kvscope-si4) TARGET_ARGS+=(--target kvscope-si4=launch:--stream-interval=4) ;;
      kvscope-si*ms) local ms=${t#kvscope-si}; TARGET_ARGS+=(--target "$t=launch:--stream-interval-ms=${ms%ms}") ;;
      null) TARGET_ARGS+=(--target null=null) ;;
      *) echo "unknown target $t (vllm, kvscope, kvscope-s256, kvscope-ms50, kvscope-api1, kvscope-api4, kvscope-si4, kvscope-si<T>ms, null)"; exit 2 ;;
    esac
  done
}

part_shape() {  # part_shape PART SHAPE [TP SUITE]
  local cfg tp=${3:-1} suite=${4:-serving}; cfg=$(mktemp -d)
  python3 -c "from pathlib import Path; from benchmarks.vllm_offline import write_config; \
write_config('$2', Path('$cfg'))"
  target_args "$(vllm_cmd "$cfg" --load-format dummy --skip-tokenizer-init --max-model-len 4096 --tensor-parallel-size "$tp")"
  # no tokenizer on either server: vLLM's runs with --skip-tokenizer-init, so kvscope's does too
  python3 benchmarks/bench_serve.py --suite "$suite" --model "dummy:$2" --device cuda \
    --server-arg=--max-model-len=4096 --server-arg=--skip-tokenizer-init --server-arg=--tensor-parallel-size="$tp" \
    "${TARGET_ARGS[@]}" --client aiohttp,openai --client-procs 4 \
    --name "serving_suite_$1_${TARGETS//,/-}_$(device_slug)" "${REST[@]}"
}

part_text() {
  python3 benchmarks/device_bundle.py ensure || { echo "text: no bundled SmolLM2 here"; return 3; }
  local folder=$HOME/.cache/kvscope/smollm2-135m-instruct
  target_args "$(vllm_cmd "$folder" --max-model-len 8192)"
  python3 benchmarks/bench_serve.py --suite text --device cuda "${TARGET_ARGS[@]}" --client aiohttp,openai \
    --client-procs 4 --name "serving_suite_text_${TARGETS//,/-}_$(device_slug)" "${REST[@]}"
}

part_client() {
  python3 benchmarks/openai_client.py cost --chunks 256 --tokens-per-chunk 1,4,8 --requests 128 --procs 4 \
    --name "serving_suite_client_cost_$(device_slug)" "${REST[@]}"
}

part="${1:-}"
shift || true
REST=("$@")
gpu_info
stamp "serving_suite $part ($TARGETS)"
case $part in
  1b) part_shape 1b llama-3.2-1b ;;
  8b) part_shape 8b llama-3.1-8b ;;
  70b) part_shape 70b llama-3.1-70b 2 serving-large ;;
  text) part_text ;;
  client) part_client ;;
  *) sed -n '2,15p' "${BASH_SOURCE[0]}"; exit 2 ;;
esac
rc=$?
stamp "serving_suite $part done (exit $rc)"
exit $rc
