"""Tensor parallelism on a multi-GPU machine, bf16, random weights, all in one run:

  allreduce   one all-reduce of 8 KiB .. 8 MiB (bf16) between two GPUs, NCCL against the one-shot custom
              all-reduce, µs a call from CUDA-graph replays
  latency     Llama-3.1-8B shape, batch 1: 128-token prompt, 256 new tokens, ms/token at TP=1 and TP=2
              (target: TP=2 <= 0.62x TP=1), TP=2 with NCCL for every all-reduce, plus TP=2 eager with step
              timings: all-reduce ms per step
  throughput  nano-vllm's workload (bench_gpu.nano_workload) on the 8B shape at TP=1 and TP=2 (and TP=2 with
              NCCL for every all-reduce)
  vllm        vLLM at TP=2 on the same two workloads (benchmarks/vllm_offline.py in its own process;
              --vllm-path is prepended to its PYTHONPATH)
  70b         the Llama-3.1-70B shape at TP=2 serving the same workload (141 GB of weights: one H200 cannot)
  vllm70b     vLLM at TP=2 on the 70B shape, the same workload

    python benchmarks/bench_tp.py [--sections allreduce,latency,throughput,vllm,70b,vllm70b] [--requests 256] [--requests-70b 256]
        [--tag _70b]
Prints a table last; writes benchmarks/results/tp_<device>[<tag>].json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_gpu import bench_vllm, nano_workload, timed_generate  # noqa: E402
from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

M8, M70 = "dummy:llama-3.1-8b", "dummy:llama-3.1-70b"


def latency(model: str, tp: int, timed: bool = False, **cfg) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=4096, max_num_seqs=8, tensor_parallel_size=tp, **cfg)
    start_s = time.perf_counter() - t0
    steps = []
    if timed:
        llm.engine.events.subscribe(lambda e: steps.append(e) if getattr(e, "kind", "") == "step" else None)
    sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate([list(range(2000, 2128))], sp, use_tqdm=False)          # warm-up (no prefix-cache hit below)
    steps.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate([list(range(1000, 1128))], sp, use_tqdm=False)[0]
    whole = (time.perf_counter() - t) / 256
    m = out.metrics
    config = ("eager, timed" if timed else "cuda graphs") + (", NCCL all-reduce" if cfg.get("disable_custom_all_reduce") else "")
    row = dict(bench="latency b=1", model=model.split(":")[1], tp=tp, config=config,
               ms_per_token=whole * 1e3, decode_step_ms=(m.last_token_time - m.first_token_time) / 255 * 1e3,
               ttft_ms=m.ttft * 1e3, start_s=start_s)
    if timed:
        dec = [s for s in steps if s.num_prefill_tokens == 0 and s.timings]
        per = lambda k: sum(s.timings.get(k, 0.0) for s in dec) / max(1, sum(s.num_decode_steps for s in dec))  # noqa: E731
        row.update(all_reduce_ms_per_step=per("all_reduce") * 1e3, all_gather_ms_per_step=per("all_gather") * 1e3,
                   forward_ms_per_step=per("forward") * 1e3)
        ranks = [s.rank_timings[1] for s in dec if s.rank_timings and 1 in s.rank_timings]
        if ranks:
            row["rank1_all_reduce_ms_per_step"] = sum(r.get("all_reduce", 0.0) for r in ranks) / len(ranks) * 1e3
    llm.engine.close()
    return row


def throughput(model: str, tp: int, prompts, outs, **cfg) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384, tensor_parallel_size=tp,
              **cfg)
    start_s = time.perf_counter() - t0
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
    dt, n = timed_generate(llm, prompts, outs)
    config = f"{len(prompts)} requests" + (", NCCL all-reduce" if cfg.get("disable_custom_all_reduce") else "")
    row = dict(bench="nano workload", model=model.split(":")[1], tp=tp, config=config,
               seconds=dt, out_tokens=n, tok_s=n / dt, start_s=start_s,
               num_kv_blocks=llm.engine.num_blocks, preemptions=llm.engine.scheduler.num_preemptions)
    llm.engine.close()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="allreduce,latency,throughput,70b")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--requests-70b", type=int, default=256)
    ap.add_argument("--vllm-path", default=os.path.expanduser("~/vsite"), help="prepended to vLLM's PYTHONPATH")
    ap.add_argument("--tag", default="", help="suffix of the JSON's name (benchmarks/results/tp_<device><tag>.json)")
    args = ap.parse_args()
    sections = args.sections.split(",")
    dev = device_name()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_tp: needs 2 CUDA devices")
    rows: list[dict] = []

    def attempt(fn, *a, **kw):
        try:
            rows.append(fn(*a, **kw))
            print(rows[-1], flush=True)
        except Exception as e:  # keep the rest of the table
            rows.append(dict(bench=fn.__name__, model=a[0], tp=a[1], config=f"failed: {type(e).__name__}: {e}"[:160]))
            print(rows[-1], flush=True)

    if "allreduce" in sections:
        from benchmarks.allreduce_ranks import run
        for r in run("bench")[0]:
            rows.append(dict(bench="all-reduce", config=f"{r['kib']} KiB bf16", nccl_us=r["nccl_us"],
                             custom_us=r["custom_us"]))
            print(rows[-1], flush=True)
    if "latency" in sections:
        attempt(latency, M8, 1)
        attempt(latency, M8, 2)
        attempt(latency, M8, 2, disable_custom_all_reduce=True)
        attempt(latency, M8, 2, timed=True, enable_cuda_graphs=False)
    prompts, outs = nano_workload(args.requests)
    if "throughput" in sections:
        attempt(throughput, M8, 1, prompts, outs)
        attempt(throughput, M8, 2, prompts, outs)
        attempt(throughput, M8, 2, prompts, outs, disable_custom_all_reduce=True)
    def peer(shape: str, requests: int, workloads: list[str]) -> None:
        """vLLM at TP=2 on `workloads` of the shape: its rows, or a row saying why it failed."""
        try:
            res = bench_vllm(shape, args.vllm_path, requests, workloads, 0, "", tensor_parallel_size=2)
            config = f"vLLM {res['version']}"
            if "latency" in workloads:
                rows.append(dict(bench="latency b=1", model=shape, tp=2, config=config,
                                 ms_per_token=res["batch1_ms_per_token"]))
            rows.append(dict(bench="nano workload", model=shape, tp=2, config=config,
                             seconds=res["nano_seconds"], tok_s=res["nano_out_tok_s"]))
        except Exception as e:  # keep the rest of the table
            rows.append(dict(bench="vllm", model=shape, tp=2, config=f"vLLM failed: {type(e).__name__}: {e}"[:160]))
        print(rows[-1], flush=True)

    def peer_row(bench: str, shape: str) -> dict | None:
        return next((r for r in rows if str(r.get("config", "")).startswith("vLLM ") and r.get("bench") == bench
                     and r.get("model") == shape), None)

    if "vllm" in sections:
        peer("llama-3.1-8b", args.requests, ["latency", "throughput"])
    if "70b" in sections:
        p70, o70 = nano_workload(args.requests_70b)
        attempt(throughput, M70, 2, p70, o70)
    if "vllm70b" in sections:
        peer("llama-3.1-70b", args.requests_70b, ["throughput"])
    by = {(r.get("bench"), r.get("model"), r.get("tp"), r.get("config")): r for r in rows}
    summary = {}
    a, b = by.get(("latency b=1", "llama-3.1-8b", 1, "cuda graphs")), by.get(("latency b=1", "llama-3.1-8b", 2, "cuda graphs"))
    if a and b:
        summary["8b_batch1_tp2_over_tp1"] = b["ms_per_token"] / a["ms_per_token"]
        summary["8b_batch1_target_met"] = summary["8b_batch1_tp2_over_tp1"] <= 0.62
    v = peer_row("latency b=1", "llama-3.1-8b")
    if b and v:
        summary["8b_batch1_tp2_over_vllm_tp2"] = b["ms_per_token"] / v["ms_per_token"]
    a = by.get(("nano workload", "llama-3.1-8b", 1, f"{args.requests} requests"))
    b = by.get(("nano workload", "llama-3.1-8b", 2, f"{args.requests} requests"))
    if a and b:
        summary["8b_nano_tp2_over_tp1"] = b["tok_s"] / a["tok_s"]
    v = peer_row("nano workload", "llama-3.1-8b")
    if b and v:
        summary["8b_nano_tp2_over_vllm_tp2"] = b["tok_s"] / v["tok_s"]
    a = by.get(("nano workload", "llama-3.1-70b", 2, f"{args.requests_70b} requests"))
    v = peer_row("nano workload", "llama-3.1-70b")
    if a and v:
        summary["70b_nano_tp2_over_vllm_tp2"] = a["tok_s"] / v["tok_s"]
    out = dict(device=dev, num_gpus=torch.cuda.device_count(), dtype="bfloat16", rows=rows, summary=summary,
               env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "NVSHMEM_DISABLE_NVLS")})
    path = write_json(f"tp_{slug(dev)}{args.tag}", out)
    print(f"\ndevice: {dev} x{torch.cuda.device_count()}; bf16; json: {path}")
    print_table(rows, ["bench", "model", "tp", "config", "nccl_us", "custom_us", "ms_per_token", "decode_step_ms", "seconds", "tok_s",
                       "all_reduce_ms_per_step", "rank1_all_reduce_ms_per_step", "forward_ms_per_step", "start_s"])
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
