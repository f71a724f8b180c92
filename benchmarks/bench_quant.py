"""Quantized weights on the GPU, one run (~4 min on an H200):

  kernels  each 8B-shape projection (qkv, o, gate_up, down) per format: the fused GEMV at M = 1 (us, GB/s of
           weight bytes) and the GEMM at M = 256, against the bf16 fused_linear / cuBLAS
  model    Llama-3.1-8B shape (dummy weights) per format, one engine each: batch-1 decode ms/token against the
           format's HBM floor (weight bytes read per step + KV, at the measured copy bandwidth), the KV blocks
           the freed memory buys, and nano-vllm's workload throughput (256 requests, 100-1024 in/out)

    python benchmarks/bench_quant.py [--sections kernels,model] [--formats none,fp8,int8,int4] [--requests 256]
                                     [--gemv auto|tc|cuda|both]
--gemv: the quantized decode GEMVs on tensor cores (kernels/quant_gemv_tc.py), CUDA cores (quant_gemv.py), the
engine's default (auto: per shape, tensor cores where the sweep found them faster), or all three. fp8's
gemm256_fp8act_us: the GEMM with activations quantized per token-group (kernels/quant_gemm_fp8.py's fp8_matmul,
cuBLAS where torch has it for the shape, else Triton, as EngineConfig.fp8_gemm="auto" picks). Prints tables last;
writes benchmarks/results/quant_<device>.json. The GEMVs' launch configs
per shape come from benchmarks/sweep_quant_gemv.py (engine/kernels/quant_gemv.py: QUANT_GEMV_CONFIGS).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_gpu import copy_bandwidth, nano_workload, timed_generate  # noqa: E402
from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.worker.model_runner import kv_bytes_per_block  # noqa: E402
from engine.quant.linear import weight_bytes  # noqa: E402

MODEL = "dummy:llama-3.1-8b"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3


def bench_kernels() -> list[dict]:
    from engine.kernels.gemv import fused_linear
    from engine.kernels.quant_gemm import quant_matmul
    from engine.kernels.quant_gemm_fp8 import cublas_supported, fp8_matmul
    from engine.kernels.quant_gemv import quant_fused_linear
    from engine.quant.formats import quantize
    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        x1 = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        xb = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
        for fmt in (None, "fp8", "int8", "int4"):
            if fmt is None:
                nbytes = w.numel() * 2
                gemv = _time_us(lambda: fused_linear(x1, w))
                gemm = _time_us(lambda: torch.nn.functional.linear(xb, w))
                extra = {}
            else:
                t = quantize(w, fmt)
                nbytes = sum(v.numel() * v.element_size() for v in t.values())
                gemv = _time_us(lambda: quant_fused_linear(x1, fmt, t, (N, K)))
                gemm = _time_us(lambda: quant_matmul(xb, fmt, t, (N, K)))
                tc = _time_us(lambda: quant_fused_linear(x1, fmt, t, (N, K), tensor_cores=True))
                extra = {"gemv1_tc_us": tc, "gemv1_tc_GBs": nbytes / tc / 1e3}
                if fmt == "fp8" and torch.cuda.get_device_capability() >= (8, 9):
                    g = "cublas" if cublas_supported(N, K) else "triton"
                    extra["gemm256_fp8act_us"] = _time_us(lambda: fp8_matmul(xb, t, gemm=g))
            rows.append(dict(bench="kernel", proj=name, format=fmt or "bf16", MB=nbytes / 1e6, gemv1_us=gemv,
                             gemv1_GBs=nbytes / gemv / 1e3, gemm256_us=gemm, **extra))
    torch.cuda.empty_cache()
    return rows


def bench_model(fmt, bw: float, prompts, outs, tensor_cores: bool | None = None, packed: bool | None = None,
                max_num_seqs: int = 256, group_dots: bool = True, fp8_gemm: str = "auto") -> dict:
    llm = LLM(MODEL, quantization=fmt, max_model_len=2048, max_num_seqs=max_num_seqs, max_num_batched_tokens=16384,
              quant_gemv_tensor_cores=tensor_cores, quant_gemv_packed=packed, quant_gemm_group_dots=group_dots,
              fp8_gemm=fp8_gemm)
    eng = llm.engine
    wb = weight_bytes(eng.model)
    embed = eng.model.model.embed_tokens.weight
    step_bytes = wb["total"] - embed.numel() * embed.element_size()       # embeddings: one row per token
    kv_tok = kv_bytes_per_block(eng.arch_config, 1, eng.dtype)
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate([list(range(2000, 2128))], sp, use_tqdm=False)            # warm-up (another prompt: no cache hit)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate([list(range(1000, 1128))], sp, use_tqdm=False)[0]
    whole = (time.perf_counter() - t) / 256
    m = out.metrics
    step = (m.last_token_time - m.first_token_time) / 255
    floor = (step_bytes + kv_tok * 256) / bw
    row = dict(bench="model", format=fmt or "bf16", gemv={True: "tc", False: "cuda", None: "per shape"}[eng.quant_tensor_cores] if fmt else "-",
               packed=getattr(eng, "quant_packed", None) if fmt else "-", group_dots=group_dots if fmt else "-",
               fp8_gemm=fp8_gemm if fmt == "fp8" else "-",
               prefill_ms=(m.first_token_time - m.arrival_time) * 1e3 if hasattr(m, "arrival_time") else None,
               max_num_seqs=max_num_seqs, weights_GB=wb["total"] / 1e9, step_GB=step_bytes / 1e9,
               kv_blocks=eng.num_blocks, kv_GB=eng.num_blocks * kv_bytes_per_block(eng.arch_config, eng.block_size,
                                                                                  eng.dtype) / 1e9,
               ms_per_token=whole * 1e3, decode_step_ms=step * 1e3, floor_ms=floor * 1e3,
               pct_floor=100 * floor / step)
    if prompts:
        dt, n = timed_generate(llm, prompts, outs)
        row.update(nano_s=dt, nano_tok_s=n / dt)
    eng.close()
    del llm, eng
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernels,model")
    ap.add_argument("--formats", default="none,fp8,int8,int4")
    ap.add_argument("--requests", type=int, default=256, help="nano workload size (0: skip throughput)")
    ap.add_argument("--gemv", default="auto", choices=("auto", "tc", "cuda", "both"),
                    help="quantized decode GEMVs: tensor cores, CUDA cores, the engine's choice, or both")
    ap.add_argument("--packed", default="auto", choices=("auto", "on", "off", "both"),
                    help="EngineConfig.quant_gemv_packed: the packed-word GEMV (kernels/quant_gemv_packed.py)")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="the engines' max_num_seqs (1: only the batch-1 decode graph is captured, a faster start; "
                         "the batch-1 figures need no more)")
    ap.add_argument("--group-dots", default="on", choices=("on", "off", "both"),
                    help="EngineConfig.quant_gemm_group_dots: the packed int4 prefill GEMM's 8 dots a group")
    ap.add_argument("--fp8-gemm", default="auto", help="EngineConfig.fp8_gemm values for fp8, comma-separated "
                                                          "(auto, triton, cublas)")
    args = ap.parse_args()
    gds = {"on": [True], "off": [False], "both": [False, True]}[args.group_dots]
    packs = {"auto": [None], "on": [True], "off": [False], "both": [True, False]}[args.packed]
    gemvs = {"auto": [None], "tc": [True], "cuda": [False], "both": [None, True, False]}[args.gemv]
    dev = device_name()
    bw = copy_bandwidth()
    kernel_rows, model_rows = [], []
    if "kernels" in args.sections:
        kernel_rows = bench_kernels()
    prompts, outs = nano_workload(args.requests) if args.requests else ([], [])
    if "model" in args.sections:
        for f in args.formats.split(","):
            fmt = None if f == "none" else f
            f8s = args.fp8_gemm.split(",") if fmt == "fp8" else ["auto"]
            for tc, pk, gd, f8 in [(t, p, d, g) for p in packs for t in gemvs for d in gds for g in f8s] if fmt \
                    else [(None, None, True, "auto")]:
                try:
                    model_rows.append(bench_model(fmt, bw, prompts, outs, tc, pk, args.max_num_seqs, gd, f8))
                except Exception as e:  # keep the rest of the table
                    model_rows.append(dict(bench="model", format=f"{f} failed: {type(e).__name__}: {e}"[:160]))
                print(model_rows[-1], flush=True)
        base = next((r for r in model_rows if r.get("format") == "bf16" and "kv_blocks" in r), None)
        for r in model_rows:
            if base and "kv_blocks" in r:
                r["kv_GB_freed"] = r["kv_GB"] - base["kv_GB"]
    out = dict(device=dev, copy_bandwidth_GBs=bw / 1e9, model=MODEL, requests=args.requests,
               kernels=kernel_rows, models=model_rows)
    path = write_json(f"quant_{slug(dev)}", out)
    print(f"\ndevice: {dev}; copy bandwidth {bw / 1e9:,.0f} GB/s; {MODEL}; json: {path}")
    if kernel_rows:
        print_table(kernel_rows, ["proj", "format", "MB", "gemv1_us", "gemv1_GBs", "gemv1_tc_us", "gemv1_tc_GBs",
                                  "gemm256_us", "gemm256_fp8act_us"])
        print()
    if model_rows:
        print_table(model_rows, ["format", "gemv", "packed", "group_dots", "fp8_gemm", "prefill_ms", "weights_GB", "step_GB", "ms_per_token", "decode_step_ms", "floor_ms",
                                 "pct_floor", "kv_blocks", "kv_GB_freed", "nano_tok_s"])


if __name__ == "__main__":
    main()
