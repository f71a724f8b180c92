#!/usr/bin/env bash
# The serving suite (512 prompts at once; 400 prompts at 24 req/s; input 512 / output 256, ratio 0.5) on a
# GPU: vLLM 0.26.0's OpenAI server (set up by ../shared/vllm-peer/README.md), kvscope's server and
# kvscope's offline LLM.generate on the same requests, one after the other, printed side by side. Every
# server workload runs twice: from one client process, and from four (--client-procs 1,4: a single Python
# client falls behind in the burst, and its own delays count as the server's).
#   bash benchmarks/serving_suite.sh [more bench_serve.py arguments, e.g. --target kvscope-k1=launch:--num-scheduler-steps=1]
set -uo pipefail
cd "$(dirname "$0")/.."
VLLM="PYTHONPATH=$HOME/vsite VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 python3 -m vllm.entrypoints.openai.api_server \
  --model $HOME/vw/configs/llama-3.2-1b --load-format dummy --skip-tokenizer-init --dtype bfloat16 --max-model-len 4096 \
  --served-model-name llama1b --port 8002"
python3 benchmarks/bench_serve.py --suite serving --model dummy:llama-3.2-1b --device cuda \
  --server-arg=--max-model-len=4096 --launch "vllm=$VLLM" --target vllm=http://127.0.0.1:8002 \
  --target kvscope=launch --target offline=offline --client-procs 1,4 --name serving_suite "$@"
