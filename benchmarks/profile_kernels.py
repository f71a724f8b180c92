"""Where a whole offline run's GPU time goes, kernel by kernel, for kvscope or vLLM on the same workload (dummy bf16
weights): torch.profiler records every CUDA kernel (graph replays included), kernels are grouped into classes by
name, and the table shows device ms per class and the top kernels, beside the run's wall time.

    python benchmarks/profile_kernels.py --engine kvscope --shape llama-3.1-8b --workload nano
    PYTHONPATH=$HOME/vsite python benchmarks/profile_kernels.py --engine vllm --shape llama-3.1-8b --workload nano
Prints the tables; writes benchmarks/results/kernels_profile_<engine>_<device>_<shape>_<workload>.json.
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the profiler sees its kernels; its warm-up
(compile, graph capture) happens before the profiled run, as kvscope's does.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_gpu import nano_workload, prefill_workload  # noqa: E402
from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402

# first match wins; names of cuBLAS / CUTLASS / FlashAttention / Triton / torch.compile kernels on Hopper
CLASSES = [
    ("sampling", r"gumbel|sampl|argmax|topk|top_k|exponential|softmax|log_softmax|multinomial"),
    ("RoPE + KV store", r"rope|rotary|kv_store|store_kv|reshape_and_cache|kvcache"),
    ("attention", r"paged_|flash|fwd_kernel|attn|attention|splitkv|combine|_merge|prefill|decode"),
    ("GEMM / GEMV", r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|fused_linear|_linear|Kernel2|splitKreduce"),
    ("RMSNorm (+ add)", r"rms|norm|rsqrt"),
    ("SiLU-and-mul", r"silu|act_and_mul|swiglu"),
    ("embedding / gather", r"embedding|index_select|gather|indexSelect"),
    ("copies / fills", r"copy|memcpy|memset|fill|cat|elementwise"),
]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def classify(name: str) -> str:
    low = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, low):
            return cls
    return "other (compiled fusions etc.)"


def kernel_table(prof, cuda: bool) -> tuple[list[dict], list[dict], float]:
    """(per-class rows, top-15 kernel rows, total device ms) from a profiler's CUDA kernel events (on a CPU-only
    machine, from its ops' self times: a smoke run of this script)."""
    per_name = defaultdict(lambda: [0.0, 0])
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for evt in prof.events():
        if evt.device_type != want:
            continue
        us = evt.device_time if cuda else evt.self_cpu_time_total
        per_name[evt.name][0] += us
        per_name[evt.name][1] += 1
    total = sum(v[0] for v in per_name.values()) / 1e3
    per_cls = defaultdict(lambda: [0.0, 0])
    for name, (us, n) in per_name.items():
        c = per_cls[classify(name)]
        c[0] += us / 1e3
        c[1] += n
    cls_rows = [dict(cls=k, ms=v[0], pct=100 * v[0] / total, kernels=v[1])
                for k, v in sorted(per_cls.items(), key=lambda kv: -kv[1][0])]
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:15]
    top_rows = [dict(kernel=n[:90], cls=classify(n), ms=v[0] / 1e3, calls=v[1], us_per_call=v[0] / v[1]) for n, v in top]
    return cls_rows, top_rows, total


def run_kvscope(shape: str, prompts, outs, max_model_len: int, **cfg):
    from engine import LLM, SamplingParams
    llm = LLM(f"dummy:{shape}", max_model_len=max_model_len, max_num_seqs=256, max_num_batched_tokens=16384, **cfg)
    # warm-up at the workload's lengths (reversed: no prefix-cache hits later), as bench_gpu.run_engine: a short
    # prompt alone left Triton specializations and first-use costs in the unprofiled run (fp8 8B nano: 12.74 s
    # unprofiled first run, 12.29 s profiled second run)
    llm.generate([p[::-1] for p in prompts[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]

    def go(shift: int):
        res = llm.generate([[t + shift for t in p] for p in prompts], params, use_tqdm=False)
        return sum(len(r.token_ids) for r in res)
    return llm, go


def run_vllm(shape: str, prompts, outs, max_model_len: int, quantization: str | None):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from benchmarks.vllm_offline import write_config
    folder = Path(tempfile.mkdtemp(prefix="vllm_cfg_"))
    write_config(shape, folder)
    llm = LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max_model_len, seed=0, quantization=quantization)
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:8]],
                 SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]

    def go(shift: int):
        res = llm.generate([{"prompt_token_ids": [t + shift for t in p]} for p in prompts], params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res)
    return llm, go


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["kvscope", "vllm"], default="kvscope")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--workload", choices=["nano", "prefill"], default="nano")
    ap.add_argument("--requests", type=int, default=0, help="default: 256 (nano) / 128 (prefill)")
    ap.add_argument("--quantization", default="", help="fp8 etc. (both engines)")
    args = ap.parse_args()
    if args.workload == "nano":
        prompts, outs = nano_workload(args.requests or 256)
        max_len = 2048
    else:
        prompts, outs = prefill_workload(args.requests or 128)
        max_len = 4200
    quant = args.quantization or None
    if args.engine == "kvscope":
        _, go = run_kvscope(args.shape, prompts, outs, max_len, **({"quantization": quant} if quant else {}))
    else:
        _, go = run_vllm(args.shape, prompts, outs, max_len, quant)
    # the profiled run's ids are shifted so that neither engine's prefix cache serves it from the first run
    sync()
    t = time.perf_counter()
    n = go(0)
    sync()
    wall_plain = time.perf_counter() - t
    cuda = torch.cuda.is_available()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        t = time.perf_counter()
        go(10000)
        sync()
        wall_prof = time.perf_counter() - t
    cls_rows, top_rows, total = kernel_table(prof, cuda)
    in_tok = sum(map(len, prompts))
    print(f"\n{args.engine} {args.shape} {args.workload}{' ' + quant if quant else ''} on {device_name()}: "
          f"wall {wall_plain:.2f} s unprofiled ({n / wall_plain:,.0f} out tok/s, {(n + in_tok) / wall_plain:,.0f} total), "
          f"{wall_prof:.2f} s profiled; GPU kernel time {total / 1e3:.2f} s ({100 * total / 1e3 / wall_prof:.0f}% busy)")
    print_table(cls_rows, ["cls", "ms", "pct", "kernels"])
    print()
    print_table(top_rows, ["kernel", "cls", "ms", "calls", "us_per_call"])
    tag = "_".join(x for x in (args.engine, slug(device_name()), args.shape, args.workload, quant) if x)
    write_json(f"kernels_profile_{tag}", dict(engine=args.engine, device=device_name(), shape=args.shape,
                                               workload=args.workload, quantization=quant, out_tokens=n,
                                               in_tokens=in_tok, wall_s=wall_plain, wall_profiled_s=wall_prof,
                                               kernel_s=total / 1e3, classes=cls_rows, top=top_rows))


if __name__ == "__main__":
    main()
