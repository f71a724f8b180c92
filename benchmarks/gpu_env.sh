# Sourced by benchmarks/gpu.sh: the environment of a GPU machine's runs, from the repository root.
#
# The machine may have no network. What it lacks travels beside the tree, in ignored folders:
#   .whl/pylib   packages missing there (llguidance for structured output, pytest-xdist for the tests suite,
#                fastapi/uvicorn/openai for the servers), unpacked wheels put on PYTHONPATH
#   .whl/tok     SmolLM2's tokenizer files, which the random-weight presets borrow (copied into the cache)
#   .devbundle/  the bundled SmolLM2 in two halves (benchmarks/device_bundle.py)
#   $VLLM_SITE   vLLM 0.26.0 as a site folder (default $HOME/vsite; ../shared/vllm-peer/README.md builds it)
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# compiled Triton (tests/conftest.py defaults to the interpreter, for CPU CI); never the network
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast off: on a host whose GPUs are shared, a program using it can take them all out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# vLLM without FlashInfer (its site folder has none): the torch sampler; no usage reports
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
VLLM_SITE="${VLLM_SITE:-$HOME/vsite}"
[ -d .whl/pylib ] && export PYTHONPATH="$PWD/.whl/pylib${PYTHONPATH:+:$PYTHONPATH}"

T0=$(date +%s)
stamp() { echo "=== $* at +$(( $(date +%s) - T0 )) s"; }

gpu_info() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
}

have_vllm() {
  PYTHONPATH="$VLLM_SITE${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import vllm" 2>/dev/null
}

install_tokenizer() {
  [ -d .whl/tok ] || return 0
  python3 -c "from pathlib import Path; from benchmarks.bench_structured import install_tokenizer; \
install_tokenizer(Path('.whl/tok'))"
}

device_slug() {
  python3 -c "from benchmarks.common import device_name, slug; print(slug(device_name('cuda')))"
}
