"""GPU end-to-end benchmarks, all in one run so every ratio is side by side (dummy weights, bf16):

  latency     batch-1 decode: 128-token prompt, 256 new tokens; whole-request ms/token and pure per-step
              decode ms/token, vs the HBM roofline (weights + KV bytes / copy BW)
  throughput  nano-vllm's workload: 256 requests of random ids, input/output uniform 100-1024, ignore_eos;
              kvscope vs HF `generate_batch` (on a subset, per token), vs the workload's HBM floor
  prefill     prefill-heavy: 128 requests, input uniform 2,048-4,096, output 32-64; total (in + out) tok/s
  longctx     nano-vllm's workload at long contexts (input 2,048-4,096): kvscope with bf16 and fp8 KV, and vLLM
              with each --kv-cache-dtype of --vllm-kv-cache-dtypes (with section vllm)
  ablation    the throughput workload with each switch flipped
  vllm        the same latency / throughput / prefill workloads on vLLM, in a subprocess
              (benchmarks/vllm_offline.py; --vllm-path is prepended to its PYTHONPATH), ratios beside kvscope

    python benchmarks/bench_gpu.py [--shape llama-3.2-1b|llama-3.1-8b|qwen3-0.6b] \
        [--sections latency,throughput,prefill,ablation,vllm] [--requests 256] [--vllm-path $HOME/vsite]
Prints a table last; writes benchmarks/results/gpu_<device>_<shape>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402

MODEL = "dummy:llama-3.2-1b"      # --shape replaces it


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
    bw = 2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3)
    del x, y
    torch.cuda.empty_cache()                       # vLLM, started after this, sizes its cache from free memory
    return bw


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


def prefill_workload(n: int = 128, seed: int = 0):
    """Prefill-heavy: n prompts of uniform 2,048-4,096 random ids, 32-64 new tokens each."""
    rng = random.Random(seed)
    in_lens = [rng.randint(2048, 4096) for _ in range(n)]
    outs = [rng.randint(32, 64) for _ in range(n)]
    ids = random.Random(seed + 1)
    return [[ids.randint(0, 10000) for _ in range(m)] for m in in_lens], outs


def long_context_workload(n: int = 256, seed: int = 0):
    """nano-vllm's workload at long contexts: n prompts of uniform 2,048-4,096 random ids, nano's output lengths
    (uniform 100-1,024). At the 8B shape its KV (~930k tokens at its peak) outgrows a bf16 pool on one 80 GB
    card, which is what an fp8 cache is for."""
    _, outs = nano_workload(n, seed)
    rng = random.Random(seed + 2)
    in_lens = [rng.randint(2048, 4096) for _ in range(n)]
    ids = random.Random(seed + 3)
    return [[ids.randint(0, 10000) for _ in range(m)] for m in in_lens], outs


LATENCY_CONFIGS = {"cuda graphs": {}, "cuda graphs, enable_pdl=False": dict(enable_pdl=False),
                   "cuda graphs, enable_pdl=True": dict(enable_pdl=True),
                   "cuda graphs, gemv_max_tokens=0": dict(gemv_max_tokens=0), "eager": dict(enable_cuda_graphs=False),
                   # the batch-1 decode kernels one switch at a time, and all back at their previous defaults
                   "gemv_variant=tiled": dict(gemv_variant="tiled"),
                   "gemv_variant=persistent": dict(gemv_variant="persistent"),
                   "sampler_one_launch=False": dict(sampler_one_launch=False),
                   "previous kernels (tiled; enable_pdl=True)": dict(gemv_variant="tiled", enable_pdl=True)}


ABLATIONS = {"kernels=torch": dict(kernels="torch"), "no cuda graphs": dict(enable_cuda_graphs=False),
             "no mixed-step cuda graphs": dict(mixed_cuda_graphs=False),
             "no chunked prefill": dict(enable_chunked_prefill=False), "static batching": dict(scheduling="static"),
             "num_scheduler_steps=1": dict(num_scheduler_steps=1),
             "multi_step_max_ms=4 (the server's default)": dict(multi_step_max_ms=4.0),
             "multi_step_admit_min=1": dict(multi_step_admit_min=1),
             "no prefix caching": dict(enable_prefix_caching=False),
             "gemv_variant=tiled": dict(gemv_variant="tiled"),
             "fused_qk_norm=False": dict(fused_qk_norm=False),           # Qwen3 (q/k norm) shapes only
             "multi_step_trim=False": dict(multi_step_trim=False)}


def bench_latency(bw: float, cfg: dict, configs: list[str]) -> list[dict]:
    weights, kv = model_bytes(cfg)
    rows = []
    for name in configs:
        sw = LATENCY_CONFIGS[name]
        llm = LLM(MODEL, max_model_len=4096, max_num_seqs=8, skip_tokenizer_init=True, **sw)
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


def timed_generate(llm: LLM, prompts, outs) -> tuple[float, int]:
    """(seconds, output tokens) of one timed generate over the workload (temperature 0.6, ignore_eos)."""
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=None) for o in outs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(r.token_ids) for r in res)
    assert n == sum(outs)
    return dt, n


def run_engine(prompts, outs, max_model_len: int = 2048, info: dict | None = None, **cfg) -> tuple[float, int]:
    """(seconds, output tokens) of the workload on a fresh engine; `info` gets its KV pool's block count."""
    # no tokenizer, as vLLM's runs (skip_tokenizer_init, detokenize=False): neither engine detokenizes random ids
    llm = LLM(MODEL, max_model_len=max_model_len, max_num_seqs=256, max_num_batched_tokens=16384,
              **{"skip_tokenizer_init": True, **cfg})
    if info is not None:
        info["num_blocks"] = llm.engine.num_blocks
    # warm-up at the workload's lengths (reversed prompts: no prefix-cache hits later): Triton specializes kernels
    # on their integer arguments, so a short prompt alone left compiles inside the timed run (H100, 1B
    # prefill-heavy: 137k total tok/s timed cold, 179-181k warm)
    llm.generate([p[::-1] for p in prompts[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    dt, n = timed_generate(llm, prompts, outs)
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


def bench_vllm(shape: str, path: str, requests: int, sections: list[str], long_requests: int,
               kv_dtypes: str, tensor_parallel_size: int = 1) -> dict:
    """{workload: figure} from benchmarks/vllm_offline.py in its own process (its own CUDA context), one process
    per KV cache dtype for the long-context workload."""
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1")
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    script = Path(__file__).resolve().parent / "vllm_offline.py"
    runs = []
    short = [w for w in ("latency", "throughput", "prefill") if w in sections]
    if short:
        runs.append(["--workloads", ",".join(short)])
    if "longctx" in sections:
        runs += [["--workloads", "longctx", "--kv-cache-dtype", kv, "--long-requests", str(long_requests)]
                 for kv in kv_dtypes.split(",") if kv]
    res: dict = {}
    for extra in runs:
        proc = subprocess.run([sys.executable, str(script), "--shape", shape, "--requests", str(requests),
                               "--tensor-parallel-size", str(tensor_parallel_size), *extra],
                              env=env, capture_output=True, text=True, timeout=900)
        sys.stderr.write(proc.stderr[-3000:])
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            raise RuntimeError(f"vllm_offline.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        res.update(json.loads(lines[-1]))
    return res


def bench_hf(prompts, n_req: int, new_tokens: int, shape: str) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.generation import GenerationConfig
    cfg = preset_config(shape)
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
    global MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", help="a dummy preset: llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, ...")
    ap.add_argument("--sections", default="latency,throughput,ablation")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prefill-requests", type=int, default=128)
    ap.add_argument("--latency-configs", default="cuda graphs,cuda graphs, enable_pdl=False,cuda graphs, gemv_max_tokens=0,"
                    "eager,previous kernels (tiled; enable_pdl=True)",
                    help=f"comma-separated, of {list(LATENCY_CONFIGS)}")
    ap.add_argument("--ablations", default="", help="comma-separated ablation names to run (default: all)")
    ap.add_argument("--prefill-ablations", default="", help="ablation names also run on the prefill-heavy workload")
    ap.add_argument("--tag", default="", help="appended to the JSON's name (a run of other sections than the record's)")
    ap.add_argument("--long-requests", type=int, default=256, help="requests of the long-context workload")
    ap.add_argument("--vllm-kv-cache-dtypes", default="auto,fp8",
                    help="vLLM's --kv-cache-dtype values run on the long-context workload (section longctx)")
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--vllm-path", default=os.path.expanduser("~/vsite"), help="prepended to vLLM's PYTHONPATH")
    ap.add_argument("--gemv-table", default="", help="a sweep_gemv.py --table-out JSON merged into the tuned tables")
    args = ap.parse_args()
    if args.gemv_table:
        from benchmarks.common import load_gemv_table
        load_gemv_table(args.gemv_table)
    MODEL = f"dummy:{args.shape}"
    sections = args.sections.split(",")
    dev = device_name()
    bw = copy_bandwidth()
    cfg = preset_config(args.shape)
    rows: list[dict] = []
    peer = {}
    if "vllm" in sections:
        try:
            peer = bench_vllm(args.shape, args.vllm_path, args.requests, sections, args.long_requests,
                              args.vllm_kv_cache_dtypes)
        except Exception as e:
            rows.append(dict(bench="vllm", config=f"vLLM failed: {type(e).__name__}: {e}"[:160]))
    if "latency" in sections:
        names = []                                  # names hold ", " themselves: a piece after ", " continues one
        for piece in args.latency_configs.split(","):
            if names and piece.startswith(" "):
                names[-1] += "," + piece
            else:
                names.append(piece)
        rows += bench_latency(bw, cfg, names)
        if "batch1_ms_per_token" in peer:
            rows.append(dict(bench="latency b=1", config=f"vLLM {peer['version']}",
                             ms_per_token=peer["batch1_ms_per_token"], ratio=peer["batch1_ms_per_token"] / rows[0]["ms_per_token"]))
    prompts, outs = nano_workload(args.requests)
    floor = workload_floor(prompts, outs, bw, cfg)
    base = None
    if "throughput" in sections:
        dt, n = run_engine(prompts, outs)
        base = n / dt
        rows.append(dict(bench="throughput", config="kvscope (defaults)", seconds=dt, out_tokens=n, tok_s=base,
                         roofline_ms=floor * 1e3, pct_roofline=100 * floor / dt))
        if "nano_out_tok_s" in peer:
            rows.append(dict(bench="throughput", config=f"vLLM {peer['version']}", tok_s=peer["nano_out_tok_s"],
                             seconds=peer["nano_seconds"], ratio=base / peer["nano_out_tok_s"]))
        try:
            if args.hf_requests <= 0:
                raise RuntimeError("skipped (--hf-requests 0)")
            hf = bench_hf(prompts, args.hf_requests, args.hf_new_tokens, args.shape)
            hf["ratio"] = base / hf["tok_s"]
            rows.append(hf)
        except Exception as e:  # keep the rest of the table
            rows.append(dict(bench="throughput", config=f"HF generate_batch failed: {type(e).__name__}: {e}"[:120]))
    if "prefill" in sections:
        pp, po = prefill_workload(args.prefill_requests)
        dt, n = run_engine(pp, po, max_model_len=4200)
        total = (sum(map(len, pp)) + n) / dt
        rows.append(dict(bench="prefill-heavy", config="kvscope (defaults)", seconds=dt, out_tokens=n, tok_s=total))
        if "prefill_total_tok_s" in peer:
            rows.append(dict(bench="prefill-heavy", config=f"vLLM {peer['version']}", tok_s=peer["prefill_total_tok_s"],
                             seconds=peer["prefill_seconds"], ratio=total / peer["prefill_total_tok_s"]))
        for name in filter(None, args.prefill_ablations.split(",")):
            dt, n = run_engine(pp, po, max_model_len=4200, **ABLATIONS[name])
            rows.append(dict(bench="prefill-heavy", config=name, seconds=dt, out_tokens=n,
                             tok_s=(sum(map(len, pp)) + n) / dt, ratio=(sum(map(len, pp)) + n) / dt / total))
    if "longctx" in sections:
        lp, lo = long_context_workload(args.long_requests)
        for kv in ("auto", "fp8"):
            info: dict = {}
            dt, n = run_engine(lp, lo, max_model_len=5200, info=info,
                               **({"kv_cache_dtype": kv} if kv != "auto" else {}))
            rows.append(dict(bench="long context", config=f"kvscope, {kv} KV", seconds=dt, out_tokens=n,
                             tok_s=n / dt, kv_blocks=info["num_blocks"]))
        for key, kv in (("longctx", "auto"), ("longctx_fp8", "fp8")):
            if f"{key}_out_tok_s" in peer:
                rows.append(dict(bench="long context", config=f"vLLM {peer['version']}, {kv} KV",
                                 tok_s=peer[f"{key}_out_tok_s"], seconds=peer[f"{key}_seconds"],
                                 kv_blocks=peer.get(f"{key}_num_gpu_blocks")))
        lc = [r for r in rows if r["bench"] == "long context" and r.get("tok_s")]
        for r in lc:
            r["ratio"] = lc[1]["tok_s"] / r["tok_s"] if len(lc) > 1 else None     # kvscope fp8 KV against each
    if "ablation" in sections:
        for name, sw in ABLATIONS.items():
            if args.ablations and name not in args.ablations.split(","):
                continue
            try:
                dt, n = run_engine(prompts, outs, **sw)
                rows.append(dict(bench="ablation", config=name, seconds=dt, out_tokens=n, tok_s=n / dt,
                                 ratio=(n / dt) / base if base else None))
            except Exception as e:
                rows.append(dict(bench="ablation", config=f"{name} failed: {type(e).__name__}: {e}"[:120]))
    out = dict(device=dev, copy_bandwidth_GBs=bw / 1e9, model=MODEL, dtype="bfloat16", vllm=peer,
               workload=dict(requests=args.requests, input_tokens=sum(map(len, prompts)), output_tokens=sum(outs),
                             hbm_floor_s=floor), rows=rows)
    path = write_json(f"gpu_{slug(dev)}_{args.shape}" + (f"_{args.tag}" if args.tag else ""), out)
    print(f"\ndevice: {dev}; copy bandwidth {bw / 1e9:,.0f} GB/s; {MODEL} bf16; json: {path}")
    print_table(rows, ["bench", "config", "seconds", "tok_s", "ms_per_token", "ttft_ms", "decode_step_ms", "roofline_ms",
                       "pct_roofline", "kv_blocks", "ratio"])


if __name__ == "__main__":
    main()
