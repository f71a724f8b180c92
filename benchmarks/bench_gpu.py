"""GPU end-to-end benchmarks (issue 3, items 2-4), all in one run so every ratio is side by side:

  latency     batch-1 decode, Llama-3.2-1B shape, bf16: 128-token prompt, 256 new tokens; whole-request
              ms/token and pure per-step decode ms/token, vs the HBM roofline (weights + KV bytes / copy BW)
  throughput  nano-vllm's workload: 256 requests of random ids, input/output uniform 100-1024, ignore_eos;
              kvscope vs HF `generate_batch` (on a subset, per token), vs the workload's HBM floor
  ablation    the throughput workload with each switch flipped

    python benchmarks/bench_gpu.py [--sections latency,throughput,ablation] [--requests 256]
Prints a table last; writes benchmarks/results/gpu_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402

MODEL = "dummy:llama-3.2-1b"


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    e.synchronize()
    return 2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3)


def model_bytes(cfg: dict) -> tuple[int, int]:
    """(weight bytes read per decode step in bf16, KV bytes per token of context)."""
    h, i, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    hd, H, Hk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    per_layer = h * (H + 2 * Hk) * hd + H * hd * h + 3 * h * i + 2 * h
    weights = (L * per_layer + V * h + h) * 2         # lm_head (tied or not) is read every step
    kv = 2 * L * Hk * hd * 2
    return weights, kv


def nano_workload(n: int, seed: int = 0):
    """Lengths from random.seed(0) (n input lengths, then n output lengths, uniform 100-1024: 144,831 input
    and 144,160 output tokens at n=256, the workload vLLM 0.26.0 was measured on); token ids from their own
    generator so they do not shift the lengths."""
    random.seed(seed)
    in_lens = [random.randint(100, 1024) for _ in range(n)]
    outs = [random.randint(100, 1024) for _ in range(n)]
    ids = random.Random(seed + 1)
    prompts = [[ids.randint(0, 10000) for _ in range(m)] for m in in_lens]
    return prompts, outs


def bench_latency(bw: float, cfg: dict) -> list[dict]:
    weights, kv = model_bytes(cfg)
    rows = []
    for name, sw in (("cuda graphs", {}), ("cuda graphs, enable_pdl=False", dict(enable_pdl=False)),
                     ("cuda graphs, gemv_max_tokens=0", dict(gemv_max_tokens=0)),
                     ("eager", dict(enable_cuda_graphs=False))):
        llm = LLM(MODEL, max_model_len=4096, max_num_seqs=8, **sw)
        prompt = list(range(1000, 1128))
        sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
        llm.generate([list(range(2000, 2128))], sp, use_tqdm=False)   # warm-up (another prompt: no cache hit)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        whole = (time.perf_counter() - t) / 256
        m = out.metrics
        step = (m.last_token_time - m.first_token_time) / 255
        avg_ctx = 128 + 128
        floor = (weights + kv * avg_ctx) / bw
        rows.append(dict(bench="latency b=1", config=name,
                         ms_per_token=whole * 1e3, ttft_ms=m.ttft * 1e3, decode_step_ms=step * 1e3, roofline_ms=floor * 1e3,
                         pct_roofline=100 * floor / step, tok_s=1 / whole))
        llm.engine.close()
    return rows


def run_engine(prompts, outs, **cfg) -> tuple[float, int]:
    llm = LLM(MODEL, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384, **cfg)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=None) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in res)
    assert n == sum(outs)
    llm.engine.close()
    return dt, n


def workload_floor(prompts, outs, bw: float, cfg: dict) -> float:
    """HBM floor: weights once per step (steps = longest request's outputs) + every KV byte written once
    and read once per decode step."""
    weights, kv = model_bytes(cfg)
    steps = max(outs)
    kv_read = sum(sum(p + j for j in range(o)) for p, o in zip(map(len, prompts), outs)) * kv
    kv_write = sum(len(p) + o for p, o in zip(prompts, outs)) * kv
    return (steps * weights + kv_read + kv_write) / bw


def bench_hf(prompts, n_req: int, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.generation import GenerationConfig
    cfg = preset_config("llama-3.2-1b")
    cfg.pop("architectures")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), dtype=torch.bfloat16,
                                             attn_implementation="paged|sdpa").cuda().eval()
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[p[:64] for p in prompts[:4]], generation_config=gc, progress_bar=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = model.generate_batch(inputs=prompts[:n_req], generation_config=gc, progress_bar=False)
    dt = time.perf_counter() - t
    n = sum(len(r.generated_tokens) for r in res.values())
    del model
    torch.cuda.empty_cache()
    return dict(bench="throughput", config=f"HF generate_batch ({n_req} req x {new_tokens} new)",
                seconds=dt, out_tokens=n, tok_s=n / dt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="latency,throughput,ablation")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    args = ap.parse_args()
    sections = args.sections.split(",")
    dev = device_name()
    bw = copy_bandwidth()
    cfg = preset_config("llama-3.2-1b")
    rows: list[dict] = []
    if "latency" in sections:
        rows += bench_latency(bw, cfg)
    prompts, outs = nano_workload(args.requests)
    floor = workload_floor(prompts, outs, bw, cfg)
    base = None
    if "throughput" in sections:
        dt, n = run_engine(prompts, outs)
        base = n / dt
        rows.append(dict(bench="throughput", config="kvscope (defaults)", seconds=dt, out_tokens=n, tok_s=base,
                         roofline_ms=floor * 1e3, pct_roofline=100 * floor / dt))
        try:
            if args.hf_requests <= 0:
                raise RuntimeError("skipped (--hf-requests 0)")
            hf = bench_hf(prompts, args.hf_requests, args.hf_new_tokens)
            hf["ratio"] = base / hf["tok_s"]
            rows.append(hf)
        except Exception as e:  # keep the rest of the table
            rows.append(dict(bench="throughput", config=f"HF generate_batch failed: {type(e).__name__}: {e}"[:120]))
    if "ablation" in sections:
        for name, sw in [("kernels=torch", dict(kernels="torch")), ("no cuda graphs", dict(enable_cuda_graphs=False)),
                         ("no chunked prefill", dict(enable_chunked_prefill=False)),
                         ("static batching", dict(scheduling="static")),
                         ("num_scheduler_steps=1", dict(num_scheduler_steps=1)),
                         ("multi_step_max_ms=4 (the server's default)", dict(multi_step_max_ms=4.0)),
                         ("multi_step_admit_min=1", dict(multi_step_admit_min=1)),
                         ("no prefix caching", dict(enable_prefix_caching=False))]:
            try:
                dt, n = run_engine(prompts, outs, **sw)
                rows.append(dict(bench="ablation", config=name, seconds=dt, out_tokens=n, tok_s=n / dt,
                                 ratio=(n / dt) / base if base else None))
            except Exception as e:
                rows.append(dict(bench="ablation", config=f"{name} failed: {type(e).__name__}: {e}"[:120]))
    out = dict(device=dev, copy_bandwidth_GBs=bw / 1e9, model=MODEL, dtype="bfloat16",
               workload=dict(requests=args.requests, input_tokens=sum(map(len, prompts)), output_tokens=sum(outs),
                             hbm_floor_s=floor), rows=rows)
    path = write_json(f"gpu_{slug(dev)}", out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], path.name).write_text(json.dumps(out, indent=2))
    print(f"\ndevice: {dev}; copy bandwidth {bw / 1e9:,.0f} GB/s; {MODEL} bf16; json: {path}")
    print_table(rows, ["bench", "config", "seconds", "tok_s", "ms_per_token", "ttft_ms", "decode_step_ms", "roofline_ms",
                       "pct_roofline", "ratio"])


if __name__ == "__main__":
    main()
