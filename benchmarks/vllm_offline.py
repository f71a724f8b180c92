"""vLLM on bench_gpu.py's workloads (batch 1, nano-vllm's workload, prefill-heavy, long context), dummy weights,
bf16, for a kvscope preset shape. Run by bench_gpu.py in its own process; prints one JSON line last.

    PYTHONPATH=$HOME/vsite python3 benchmarks/vllm_offline.py --shape llama-3.1-8b
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import long_context_workload, nano_workload, prefill_workload  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2"}


def write_config(shape: str, folder: Path) -> None:
    cfg = preset_config(shape)
    cfg.update(model_type=_MODEL_TYPES[cfg["architectures"][0]], hidden_act="silu", torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(cfg))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefill-requests", type=int, default=128)
    ap.add_argument("--long-requests", type=int, default=256)
    ap.add_argument("--workloads", default="latency,throughput,prefill", help="of latency, throughput, prefill, longctx")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (auto: the model's dtype)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    folder = Path(tempfile.mkdtemp(prefix="vllm_cfg_"))
    write_config(args.shape, folder)
    llm = LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=5200 if "longctx" in workloads else 4200, seed=0, kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size)
    res = {"version": vllm.__version__, "shape": args.shape, "tensor_parallel_size": args.tensor_parallel_size}

    def timed(prompts, params):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in out)

    def sampled(outs):
        return [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]

    prompts, outs = nano_workload(args.requests)
    timed([p[:64] for p in prompts[:8]], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False))
    if "latency" in workloads:
        p1 = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True, detokenize=False)
        timed([list(range(2000, 2128))], p1)
        dt, _ = timed([list(range(1000, 1128))], p1)             # the prompt bench_gpu's latency section uses
        res["batch1_ms_per_token"] = dt / 256 * 1e3
    if "throughput" in workloads:
        dt, n = timed(prompts, sampled(outs))
        res.update(nano_seconds=dt, nano_out_tok_s=n / dt)
    if "prefill" in workloads:
        pp, po = prefill_workload(args.prefill_requests)
        dt, n = timed(pp, sampled(po))
        res.update(prefill_seconds=dt, prefill_total_tok_s=(sum(map(len, pp)) + n) / dt)
    if "longctx" in workloads:
        lp, lo = long_context_workload(args.long_requests)
        timed([p[::-1] for p in lp[:8]], SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False))
        dt, n = timed(lp, sampled(lo))
        key = "longctx" if args.kv_cache_dtype == "auto" else f"longctx_{args.kv_cache_dtype}"
        try:
            blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        except AttributeError:
            blocks = None
        res.update({f"{key}_seconds": dt, f"{key}_out_tok_s": n / dt, f"{key}_num_gpu_blocks": blocks})
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
