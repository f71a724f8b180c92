"""Where the time goes: the benchmarks say how fast, these profiles say why. One subcommand per question:

    python benchmarks/profiler.py kernels --engine kvscope|vllm [--shape llama-3.1-8b]
            [--workload nano|prefill|longctx|decode|burst] [--kv-cache-dtype fp8]
        a whole offline run's GPU time per kernel class and top kernels, kvscope or vLLM on the same workload
        (burst: the serving suite's 512 prompts at once, each engine with its server's settings;
        PYTHONPATH=$HOME/vsite for vLLM)                               -> kernels_profile_<engine>_<device>_...
    python benchmarks/profiler.py decode [--shape llama-3.1-8b] [--steps 8] [--pdl 0] [--gemv-table T.json] [--tp 2]
        one batch-1 decode step's kernels per iteration (rank 0's with --tp), against the HBM floor and the
        unprofiled wall time per iteration                          -> profile_decode_<device>_<shape>[_tp2]
    python benchmarks/profiler.py steps [--configs default,nochunk] [--model dummy:llama-3.1-8b]
        the engine's own step events of a throughput run, by step kind           -> profile_steps_<device>
    python benchmarks/profiler.py tiers [--model dummy:llama-3.2-1b] [--num-kv-blocks 256]
        the multi-turn workload one turn at a time with and without the host tier: TTFT, the copies' GPU time
        and host cost, every kernel class; on cuda also the block copies alone (kv_transfer vs a memcpy per
        block)                                                            -> profile_tiers_<device>_<shape>
    python benchmarks/profiler.py structured [--batch 32] [--mask-threads 0 2 4] [--feed seq par] [--pin 0 1]
        a constrained decode iteration's host phases and GPU busy time           -> profile_structured_<device>
    python benchmarks/profiler.py launch [--batch 32]
        host cost of a grammar iteration's launches and copies, GPU idle vs busy -> probe_launch_cost_<device>
    python benchmarks/profiler.py spec-steps [--methods none,ngram] [--cost-ratio 2]
        on the CPU: what kinds of steps a speculative engine takes against plain decoding  -> spec_steps<tag>
    python benchmarks/profiler.py spec-times --device cuda --model dummy:llama-3.2-1b
        every engine.step() of a speculative engine timed and classed            -> spec_step_times_<device><tag>

    python benchmarks/profiler.py host [--batch 512] [--out-len 200] [--skip-tokenizer-init] [--outputs cumulative]
        the engine process's host work for one decode iteration of a large batch, by phase, per request: what a
        server's decode block costs the host while the GPU runs the next one (no model forward)  -> profile_host_<cpu>

Each prints a table and writes its JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# run as a script, this folder leads sys.path, where this file would shadow the standard library's `profile`
ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0]).resolve() == ROOT / "benchmarks":
    sys.path[0] = str(ROOT)
elif str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.bench_gpu import (copy_bandwidth, long_context_workload, model_bytes, nano_workload,  # noqa: E402
                                  prefill_workload)  # noqa: E402
from benchmarks.bench_spec import WORKLOADS, run_mode, switch_drafter  # noqa: E402
from benchmarks.common import device_name, load_gemv_table, print_table, slug, write_json  # noqa: E402
from engine.config import SERVER_ENGINE_DEFAULTS  # noqa: E402

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4)
NOT_KERNELS = ("aten::", "cuda", "Activity", "ProfilerStep")      # profiler rows that are not device kernels


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- kernels: a whole run, kvscope or vLLM ----------------------------------------------------------------

# first match wins; names of cuBLAS / CUTLASS / FlashAttention / Triton / torch.compile kernels on Hopper
CLASSES = [
    ("host -> device copies", r"memcpy htod"),
    ("device -> host copies", r"memcpy dtoh"),
    ("sampling", r"gumbel|sampl|argmax|topk|top_k|exponential|softmax|log_softmax|multinomial"),
    ("RoPE + KV store", r"rope|rotary|kv_store|store_kv|reshape_and_cache|kvcache"),
    ("attention", r"paged_|flash|fwd_kernel|attn|attention|sdpa|fmha|splitkv|combine|_merge|prefill|decode"),
    ("GEMM / GEMV", r"gemm|gemv|nvjet|xmma|cutlass|cublas|matmul|fused_linear|_linear|Kernel2|splitKreduce"),
    ("RMSNorm (+ add)", r"rms|norm|rsqrt"),
    ("SiLU-and-mul", r"silu|act_and_mul|swiglu"),
    ("embedding / gather", r"embedding|index_select|gather|indexSelect"),
    ("copies / fills", r"copy|memcpy|memset|fill|cat|elementwise"),
]


def classify(name: str) -> str:
    low = name.lower()
    for cls, pat in CLASSES:
        if re.search(pat, low):
            return cls
    return "other (compiled fusions etc.)"


def kernel_table(prof, cuda: bool) -> tuple[list[dict], list[dict], float]:
    """(per-class rows, top-15 kernel rows, total device ms) from a profiler's CUDA kernel events (on a CPU-only
    machine, from its ops' self times: a smoke run)."""
    per_name = defaultdict(lambda: [0.0, 0])
    want = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    for evt in prof.events():
        if evt.device_type != want:
            continue
        per_name[evt.name][0] += evt.device_time if cuda else evt.self_cpu_time_total
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


def kvscope_runner(shape: str, prompts, outs, max_model_len: int, **cfg):
    from engine import LLM, SamplingParams
    llm = LLM(f"dummy:{shape}", max_model_len=max_model_len, **{"max_num_seqs": 256, "max_num_batched_tokens": 16384,
                                                                   **cfg})
    # warm-up at the workload's lengths (reversed: no prefix-cache hits later), as bench_gpu.run_engine: a short
    # prompt alone left Triton specializations and first-use costs in the unprofiled run (fp8 8B nano: 12.74 s
    # unprofiled first run, 12.29 s profiled second run)
    llm.generate([p[::-1] for p in prompts[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]

    def go(shift: int) -> int:
        res = llm.generate([[t + shift for t in p] for p in prompts], params, use_tqdm=False)
        return sum(len(r.token_ids) for r in res)
    return go


def vllm_runner(shape: str, prompts, outs, max_model_len: int, quantization: str | None, kv_cache_dtype: str,
                **cfg):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")      # in this process: the profiler sees it
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams

    from benchmarks.vllm_offline import write_config
    folder = Path(tempfile.mkdtemp(prefix="vllm_cfg_"))
    write_config(shape, folder)
    llm = LLM(model=str(folder), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=max_model_len, seed=0, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **cfg)
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:8]],
                 SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, detokenize=False) for o in outs]

    def go(shift: int) -> int:
        res = llm.generate([{"prompt_token_ids": [t + shift for t in p]} for p in prompts], params, use_tqdm=False)
        return sum(len(r.outputs[0].token_ids) for r in res)
    return go


def decode_workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n requests admitted at once, prompts of 256-768 tokens and 256 output tokens each: after the first step the
    batch decodes n sequences, the batch a server keeps at 24 req/s with outputs of 256 (8B shape: ~60)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(256, 769, (n,), generator=g).tolist()
    return [torch.randint(0, 10000, (k,), generator=g).tolist() for k in lens], [256] * n


def burst_workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The serving suite's burst as one offline batch: decode_workload's prompts (256-768 random ids) with 128-384
    output tokens (input 512 / output 256, range ratio 0.5), all admitted at once."""
    prompts, _ = decode_workload(n, seed)
    return prompts, torch.randint(128, 385, (n,), generator=torch.Generator().manual_seed(seed + 1)).tolist()


def serving_configs() -> tuple[dict, dict]:
    """(kvscope, vLLM) engine settings of their OpenAI servers, for an offline run that stands in for one: kvscope's
    server defaults (a pool-derived max_num_seqs, its device token budget, 4 ms multi-step blocks) and vLLM's
    (8,192 batched tokens and 1,024 sequences on an H100 or H200, where its offline LLM takes 16,384)."""
    return ({"max_num_seqs": None, "max_num_batched_tokens": None,
             "multi_step_max_ms": SERVER_ENGINE_DEFAULTS["multi_step_max_ms"]},
            {"max_num_batched_tokens": 8192, "max_num_seqs": 1024})


def cmd_kernels(args) -> None:
    """torch.profiler records every CUDA kernel of a whole offline run (graph replays included); kernels are
    grouped into classes by name. vLLM runs in this process with its warm-up (compile, graph capture) before
    the profiled run, as kvscope's."""
    if args.workload == "nano":
        prompts, outs = nano_workload(args.requests or 256)
        max_len = 2048
    elif args.workload == "prefill":
        prompts, outs = prefill_workload(args.requests or 128)
        max_len = 4200
    elif args.workload == "decode":
        prompts, outs = decode_workload(args.requests or 64)
        max_len = 2048
    elif args.workload == "burst":
        prompts, outs = burst_workload(args.requests or 512)
        max_len = 4096
    else:
        prompts, outs = long_context_workload(args.requests or 200)
        max_len = 5200
    quant = args.quantization or None
    kv_dtype = args.kv_cache_dtype
    kv_serving, vllm_serving = serving_configs() if args.workload == "burst" else ({}, {})
    if args.engine == "kvscope":
        cfg = dict(kv_serving, **{k: json.loads(v) for k, _, v in (kv.partition("=") for kv in args.set)})
        cfg.update({"quantization": quant} if quant else {})
        cfg.update({"kv_cache_dtype": kv_dtype} if kv_dtype != "auto" else {})
        go = kvscope_runner(args.shape, prompts, outs, max_len, **cfg)
    else:
        go = vllm_runner(args.shape, prompts, outs, max_len, quant, kv_dtype, **vllm_serving)
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
    dev = device_name()
    print(f"\n{args.engine} {args.shape} {args.workload}{' ' + quant if quant else ''} {kv_dtype} KV on {dev}: "
          f"wall {wall_plain:.2f} s unprofiled ({n / wall_plain:,.0f} out tok/s, {(n + in_tok) / wall_plain:,.0f} total), "
          f"{wall_prof:.2f} s profiled; GPU kernel time {total / 1e3:.2f} s ({100 * total / 1e3 / wall_prof:.0f}% busy)")
    print_table(cls_rows, ["cls", "ms", "pct", "kernels"])
    print()
    print_table(top_rows, ["kernel", "cls", "ms", "calls", "us_per_call"])
    tag = "_".join(x for x in (args.engine, slug(dev), args.shape, args.workload, quant,
                               None if kv_dtype == "auto" else f"kv{kv_dtype}") if x)
    tag += "".join(f"_{slug(kv)}" for kv in args.set)
    write_json(f"kernels_profile_{tag}", dict(engine=args.engine, device=dev, shape=args.shape,
                                               workload=args.workload, quantization=quant, kv_cache_dtype=kv_dtype,
                                               set=args.set, out_tokens=n, in_tokens=in_tok, wall_s=wall_plain,
                                               wall_profiled_s=wall_prof, kernel_s=total / 1e3, classes=cls_rows, top=top_rows))


# ---- decode: one batch-1 decode step ----------------------------------------------------------------------

def cmd_decode(args) -> None:
    """A dummy preset's shape, bf16, one 128-token prompt: one (multi-)step of its decode under torch.profiler,
    kernels per decode iteration, against the HBM floor (weight + KV bytes / measured copy bandwidth, a rank's
    share with --tp) and the wall time of unprofiled iterations. Device time well under the wall time: the host
    (or, with --tp, waiting on the other ranks' hosts) bounds the step."""
    from engine import LLM, SamplingParams
    from engine.models.presets import preset_config
    if args.gemv_table:
        load_gemv_table(args.gemv_table)
    bw = copy_bandwidth()
    weights, kv = model_bytes(preset_config(args.shape))
    llm = LLM(f"dummy:{args.shape}", max_model_len=4096, max_num_seqs=8, num_scheduler_steps=args.steps,
              gemv_max_tokens=args.gemv, enable_pdl=bool(args.pdl), tensor_parallel_size=args.tp)
    eng = llm.engine
    eng.add_request(list(range(1000, 1128)), SamplingParams(temperature=0, max_tokens=1024, ignore_eos=True))
    for _ in range(6):
        eng.step()
    sync()
    t0, n0 = time.perf_counter(), eng.scheduler.running[0].num_output_tokens
    for _ in range(8):
        eng.step()
    sync()
    wall_us = (time.perf_counter() - t0) * 1e6 / (eng.scheduler.running[0].num_output_tokens - n0)
    eng.profile_step()
    eng.step()
    iters = args.steps
    floor_us = (weights + kv * 200) / args.tp / bw * 1e6
    rows = [dict(kernel=r["name"][:100], us=r["device_time_ms"] * 1e3 / iters, calls=r["count"] // iters)
            for r in eng.last_profile if r["device_time_ms"] and not r["name"].startswith(NOT_KERNELS)]
    total = sum(r["us"] for r in rows)
    eng.close()
    dev = device_name()
    print(f"{dev}: TP={args.tp}, HBM floor per token {floor_us:.0f} us (copy {bw / 1e9:.0f} GB/s); per decode "
          f"iteration: wall {wall_us:.0f} us unprofiled, device total {total:.0f} us (profiled step / {iters}, "
          f"{100 * floor_us / total:.0f}% of the floor)")
    print_table(rows, ["us", "calls", "kernel"])
    write_json(f"profile_decode_{slug(dev)}_{args.shape}" + (f"_tp{args.tp}" if args.tp > 1 else ""), dict(
        device=dev, shape=args.shape, steps=iters, tp=args.tp, gemv_max_tokens=args.gemv, enable_pdl=bool(args.pdl),
        gemv_table=args.gemv_table or None, copy_GBps=bw / 1e9, floor_us=floor_us, wall_us=wall_us, total_us=total,
        rows=rows))


# ---- steps: a throughput run's steps by kind --------------------------------------------------------------

STEP_CONFIGS = {"default": {}, "nochunk": dict(enable_chunked_prefill=False),
                "budget4k": dict(max_num_batched_tokens=4096), "nographs": dict(enable_cuda_graphs=False),
                "single": dict(num_scheduler_steps=1), "multi4": dict(num_scheduler_steps=4),
                "multi16": dict(num_scheduler_steps=16)}


def cmd_steps(args) -> None:
    """nano-vllm's workload under a few configs with an event listener: the engine's own StepEvents summed by
    step kind (the inspector's data, as a table); --torch-profile adds a kernel table of chosen steps."""
    from engine import LLM, SamplingParams
    prof_steps = {int(s) for s in args.torch_profile.split(",") if s}
    profiles = []
    prompts, outs = nano_workload(args.requests)
    rows = []
    for name in args.configs.split(","):
        cfg = {**dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384,
                      enable_step_timings=False), **STEP_CONFIGS[name]}
        llm = LLM(args.model, **cfg)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
        events = []
        eng = llm.engine
        step0 = eng.step_index

        def listen(e, name=name, eng=eng, events=events, step0=step0):
            if getattr(e, "kind", "") != "step":
                return
            if eng.last_profile is not None:        # the previous step ran under the profiler
                p = events[-1]
                profiles.append((name, p.step - step0, len(p.scheduled), p.num_prefill_tokens, p.end - p.start,
                                 eng.last_profile))
                eng.last_profile = None
            events.append(e)
            if e.step + 1 - step0 in prof_steps:
                eng.profile_step()
        eng.events.subscribe(listen)
        params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
        sync()
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t
        agg = defaultdict(lambda: defaultdict(float))
        for e in events:
            kind = "graph decode" if e.cuda_graph else ("eager decode" if e.num_prefill_tokens == 0 else "mixed/prefill")
            if e.num_decode_steps > 1:
                kind = f"{kind} x{e.num_decode_steps}"
            a = agg[kind]
            a["steps"] += 1
            a["ms"] += (e.end - e.start) * 1e3
            a["batch"] += len(e.scheduled)
            a["tokens"] += e.num_prefill_tokens + e.num_decode_tokens
            for k, v in e.timings.items():
                a[k] += v * 1e3
        for kind, a in agg.items():
            n = a["steps"]
            rows.append(dict(config=name, kind=kind, steps=int(n), total_s=a["ms"] / 1e3, step_ms=a["ms"] / n,
                             batch=a["batch"] / n, tokens=a["tokens"] / n,
                             **{k: a[k] / n for k in ("schedule", "prepare", "forward", "sampling", "postprocess")}))
        rows.append(dict(config=name, kind="WALL", total_s=wall, steps=len(events)))
        eng.close()
        print(rows[-1], flush=True)
    for name, step, batch, npre, wall, prof in profiles:
        print(f"\n== {name}: step {step}, {batch} seqs, {npre} prefill tokens, {wall * 1e3:.2f} ms wall (profiled)")
        dev_total = sum(r["device_time_ms"] for r in prof if not r["name"].startswith(("ProfilerStep", "aten::")))
        print(f"   device kernels total (top 40, excl. aten wrappers) {dev_total:.2f} ms")
        for r in prof[:25]:
            print(f"   {r['device_time_ms']:8.3f} ms dev {r['cpu_time_ms']:8.3f} ms cpu x{r['count']:<4} {r['name'][:90]}")
    print_table(rows, ["config", "kind", "steps", "total_s", "step_ms", "batch", "tokens", "schedule", "prepare",
                       "forward", "sampling", "postprocess"])
    dev = device_name()
    write_json(f"profile_steps_{slug(dev)}", dict(device=dev, model=args.model, requests=args.requests, rows=rows))


# ---- tiers: the multi-turn workload with and without the host tier -------------------------------------------

def copy_rates(eng, n: int) -> list[dict]:
    """n random blocks between the engine's pool and its host tier: kv_transfer (one launch, the kernel reading
    or writing pinned memory) against the copy engines' way (a memcpy per block into staging, then a scatter);
    host time to issue a call and device time per call (cuda only)."""
    from engine.kernels.kv_transfer import blocks_view, kv_transfer, pool_view
    r = eng.runner
    kv, host = r.kv_cache, r.host_kv
    g = torch.Generator().manual_seed(0)
    dev_blocks = torch.randperm(kv.shape[2] - 1, generator=g)[:n] + 1
    host_blocks = torch.randperm(host.shape[0], generator=g)[:n]
    d_idx, h_idx = dev_blocks.int().to(kv.device), host_blocks.int().to(kv.device)
    kvb, hb = kv.view(torch.uint8), host.view(torch.uint8)

    def memcpy_in():
        staged = torch.empty((n, *hb.shape[1:]), dtype=torch.uint8, device=kv.device)
        for i, h in enumerate(host_blocks.tolist()):
            staged[i].copy_(hb[h], non_blocking=True)
        kvb.index_copy_(2, dev_blocks.to(kv.device), staged.movedim(0, 2))

    calls = {"memcpy per block, in": memcpy_in,
             "kv_transfer, in": lambda: kv_transfer(blocks_view(host), pool_view(kv), h_idx, d_idx),
             "kv_transfer, out": lambda: kv_transfer(pool_view(kv), blocks_view(host), d_idx, h_idx)}
    block_bytes = hb[0].numel()
    rows = []
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        sync()
        reps = 20
        t = time.perf_counter()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        host_us = (time.perf_counter() - t) / reps * 1e6
        e1.record()
        sync()
        dev_us = e0.elapsed_time(e1) / reps * 1e3
        rows.append(dict(copy=name, blocks=n, block_mib=block_bytes / 2**20, host_us=host_us, device_us=dev_us,
                         gb_s=n * block_bytes / dev_us / 1e3))
    return rows


TURN_STEP_PHASES = ("step", "gpu", "schedule", "swap_blocks", "prepare", "execute", "sample (waits)", "process")


def time_turn_steps(eng) -> list[dict]:
    """Host seconds per phase of every step that samples a request's first token, and the GPU's seconds from the
    step's start to its end (CUDA events; the host timers alone elsewhere). Wrappers around the engine's parts
    change nothing it does: no step events, so no timed eager forwards (the engine's own step timings would run
    some of its graphs eagerly)."""
    rows, cur = [], defaultdict(float)
    cuda = eng.device.type == "cuda"
    for obj, attr, key in ((eng.scheduler, "schedule", "schedule"), (eng.runner, "swap_blocks", "swap_blocks"),
                           (eng.runner, "prepare", "prepare"), (eng.runner, "execute", "execute"),
                           (eng, "sampler", "sample (waits)"), (eng, "_process_outputs", "process")):
        setattr(obj, attr, timed(cur, key, getattr(obj, attr)))
    step = eng.step
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None

    def timed_step():
        cur.clear()
        if cuda:
            events[0].record()
        t = time.perf_counter()
        outs = step()
        dt = time.perf_counter() - t
        if cur.get("prepare") and any(len(o.token_ids) == 1 for o in outs):
            gpu = dt
            if cuda:                        # (the step waited for its tokens: this wait costs nothing more)
                events[1].record()
                events[1].synchronize()
                gpu = events[0].elapsed_time(events[1]) / 1e3
            rows.append(dict({k: 0.0 for k in TURN_STEP_PHASES}, **cur, step=dt, gpu=gpu))
        return outs
    eng.step = timed_step
    return rows


def cmd_tiers(args) -> None:
    """bench_kv_tiers.py's multi-turn workload, one turn at a time, with and without the host tier. Per config:
    a warm-up, an unprofiled run (its TTFT is the benchmark's), then a run under torch.profiler: the GPU time per
    kernel class (the host tier's copies as their own classes) and the host time spent issuing the block copies."""
    from benchmarks.bench_kv_tiers import multi_turn, multi_turn_shape
    from engine import LLMEngine
    users, turn_len, answer, max_len = multi_turn_shape(args.num_kv_blocks, args.turns)
    rows, tables, steps_rows = [], {}, []
    for name, extra in (("no host tier", {}), ("host tier", dict(kv_offload_gib=args.offload_gib))):
        def engine():
            return LLMEngine(model=args.model, device=args.device, block_size=16, num_kv_blocks=args.num_kv_blocks,
                             max_model_len=max_len, **extra)
        eng = engine()
        multi_turn(eng, users, 2, turn_len, answer, seed=1, together=False)             # warm-up
        eng.close()
        eng = engine()
        if extra and eng.device.type == "cuda":
            copies = copy_rates(eng, args.copy_blocks)
            print("== the host tier's block copies alone")
            print_table(copies, ["copy", "blocks", "block_mib", "host_us", "device_us", "gb_s"])
            tables["copies"] = copies
        turn_steps = time_turn_steps(eng)
        plain = multi_turn(eng, users, args.turns, turn_len, answer, seed=0, together=False)
        eng.close()
        n = max(1, len(turn_steps))
        phases = {k: sum(r[k] for r in turn_steps) / n * 1e3 for k in TURN_STEP_PHASES}
        steps_rows.append(dict(config=name, steps=len(turn_steps), **phases))
        if not args.torch_profile:
            rows.append(dict(config=name, ttft_ms=plain["ttft_mean_s"] * 1e3, wall_s=plain["wall_s"],
                             fetched=plain["blocks_fetched"], offloaded=plain["blocks_offloaded"]))
            continue
        eng = engine()
        spent = {"swap_blocks": 0.0, "calls": 0}
        swap = eng.runner.swap_blocks

        def timed_swap(out, inn, swap=swap, spent=spent):
            t = time.perf_counter()
            swap(out, inn)
            spent["swap_blocks"] += time.perf_counter() - t
            spent["calls"] += bool(out or inn)
        eng.runner.swap_blocks = timed_swap
        cuda = eng.device.type == "cuda"
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            profiled = multi_turn(eng, users, args.turns, turn_len, answer, seed=0, together=False)
            sync()
        eng.close()
        cls_rows, top_rows, total = kernel_table(prof, cuda)
        host_ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        host_rows = [dict(op=e.key[:70], ms=e.self_cpu_time_total / 1e3, calls=e.count) for e in host_ops]
        tables[name] = dict(classes=cls_rows, top=top_rows, host_ops=host_rows)
        rows.append(dict(config=name, ttft_ms=plain["ttft_mean_s"] * 1e3, wall_s=plain["wall_s"],
                         profiled_ttft_ms=profiled["ttft_mean_s"] * 1e3, profiled_wall_s=profiled["wall_s"],
                         device_ms=total, swap_host_ms=spent["swap_blocks"] * 1e3, swap_calls=spent["calls"],
                         fetched=plain["blocks_fetched"], offloaded=plain["blocks_offloaded"]))
        print(f"\n== {name}: device time by class (profiled run)")
        print_table(cls_rows, ["cls", "ms", "pct", "kernels"])
        print(f"== {name}: host time by op, self (profiled run)")
        print_table(host_rows, ["op", "ms", "calls"])
    print("== the steps that gave each turn its first token (unprofiled run), mean ms: host time in each phase, "
          "and the GPU's time from the step's start to its end")
    print_table(steps_rows, list(dict.fromkeys(k for r in steps_rows for k in r)))
    tables["prefill_steps"] = steps_rows
    print_table(rows, ["config", "ttft_ms", "wall_s", "profiled_ttft_ms", "profiled_wall_s", "device_ms",
                       "swap_host_ms", "swap_calls", "fetched", "offloaded"])
    dev = device_name(args.device)
    shape = (args.model or "smollm2-135m").removeprefix("dummy:")
    write_json(f"profile_tiers_{slug(dev)}_{slug(Path(shape).name)}",
               dict(device=dev, model=args.model, num_kv_blocks=args.num_kv_blocks, turns=args.turns, users=users,
                    turn_len=turn_len, answer=answer, rows=rows, tables=tables))


# ---- structured: a constrained decode iteration -----------------------------------------------------------

def timed(spent: dict, key: str, fn):
    """fn, adding its wall seconds to spent[key] on every call."""
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper


def run_structured(eng, B: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """(seconds, iterations) of the steps where all B requests decode."""
    from benchmarks.bench_structured import PROMPT, SCHEMA
    from engine import SamplingParams, StructuredOutputsParams
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so)
    for _ in range(B):
        eng.add_request(PROMPT, sp)
    for _ in range(3):                              # prefill and the first blocks
        eng.step()
    sync()
    t, n = time.perf_counter(), 0
    while eng.has_unfinished_requests() and all(s.num_output_tokens < max_tokens - 16 for s in eng.scheduler.running):
        n += sum(len(o.delta_token_ids) for o in eng.step())
    sync()
    dt = time.perf_counter() - t
    while eng.has_unfinished_requests():
        eng.step()
    return dt, n // B


def cmd_structured(args) -> None:
    """A batch constrained to bench_structured's JSON schema decodes in grammar blocks; each phase of
    MultiStepDecoder._sample_grammar_block's loop is wrapped with a host timer, and the GPU's busy time per iteration
    comes from torch.profiler. The GPU idles whenever the host chain (wait for the last tokens, feed the
    grammars, fill and apply the masks, launch the sampler and the next forward) outlasts the forward in flight.
    --mask-threads: structured_mask_threads per constrained run (0: llguidance's default); --feed par: feed the
    grammars through llguidance's parallel consume_token_par; --pin 1: the sampler's small host lists copied
    from pinned memory (a pageable copy may wait for the stream)."""
    from benchmarks.bench_structured import PROMPT, SCHEMA, install_tokenizer
    from engine import LLMEngine, SamplingParams, StructuredOutputsParams
    from engine.sample import sampler
    from engine.worker import multi_step
    from engine.worker.host_copy import HostCopy
    if args.tokenizer_dir is not None:
        install_tokenizer(args.tokenizer_dir)
    cpu = args.device == "cpu"
    eng = LLMEngine(model=args.model, device=args.device, max_num_seqs=args.batch, enable_prefix_caching=False,
                    **(dict(structured_overlap=True, num_scheduler_steps=4, cpu_kv_cache_gib=0.25) if cpu else {}))
    spent: dict[str, float] = defaultdict(float)
    mode = {"feed": "seq"}

    def feed_par(seqs, tokens):
        live = [(s, t) for s, t in zip(seqs, tokens) if s.matcher is not None and not s.is_finished
                and not (s.matcher.is_stopped() or s.matcher.is_error())]
        oks = eng.structured.bitmask.executor.consume_token_par([(s.matcher, t) for s, t in live])
        for (s, _), ok in zip(live, oks):
            m = s.matcher
            s.grammar_ahead.append((("stop" if m.is_stopped() else None), None) if ok
                                   else ("stop", f"grammar error: {m.get_error()}"))
    feed = {"seq": multi_step.feed_grammars, "par": feed_par}
    multi_step.feed_grammars = timed(spent, "feed grammars", lambda *a: feed[mode["feed"]](*a))
    multi_step.sample_on_device = timed(spent, "sample (launch)", multi_step.sample_on_device)
    eng.structured.apply = timed(spent, "fill + apply masks", eng.structured.apply)
    eng.runner.execute = timed(spent, "forward (launch)", eng.runner.execute)
    HostCopy.tolist = timed(spent, "wait for tokens", HostCopy.tolist)
    eng.multi_step._sample_grammar_block = timed(spent, "grammar block (all)", eng.multi_step._sample_grammar_block)
    run_structured(eng, 2, 8, True)                 # compile the grammar, warm up
    rows = []
    to_dev = {0: sampler._to_dev,
              1: lambda v, device, dtype=None: torch.tensor(v, dtype=dtype, pin_memory=device.type == "cuda").to(
                  device, non_blocking=True)}
    runs = [(False, None, "seq", 0)] + [(True, n or None, f, p) for n in args.mask_threads for f in args.feed
                                        for p in args.pin]
    for constrained, threads, mode["feed"], pin in runs:
        eng.structured.mask_threads, eng.structured.bitmask = threads, None     # a new bitmask, these threads
        sampler._to_dev = to_dev[pin]
        label = (f"on, {threads or 'default'} threads, feed {mode['feed']}{', pinned' if pin else ''}"
                 if constrained else "off")
        for k in list(spent):
            spent[k] = 0.0
        dt, iters = run_structured(eng, args.batch, args.max_tokens, constrained)
        rows.append(dict(constraints=label, phase="wall per iteration", us=1e6 * dt / max(iters, 1)))
        for k, v in spent.items():
            rows.append(dict(constraints=label, phase=k, us=1e6 * v / max(iters, 1)))
        if cpu:
            continue
        # GPU busy time per iteration over a few steps in the middle of a run
        so = StructuredOutputsParams(json=SCHEMA) if constrained else None
        sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=not constrained,
                            structured_outputs=so)
        for _ in range(args.batch):
            eng.add_request(PROMPT, sp)
        for _ in range(4):
            eng.step()
        sync()
        n0 = sum(s.num_output_tokens for s in eng.scheduler.running)
        t = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                eng.step()
            sync()
        wall = time.perf_counter() - t
        it = max(1, (sum(s.num_output_tokens for s in eng.scheduler.running) - n0) // args.batch)
        kernels = [e for e in prof.key_averages() if e.device_time_total and not e.key.startswith(NOT_KERNELS)]
        busy = sum(e.device_time_total for e in kernels) / 1e3                                  # ms
        rows.append(dict(constraints=label, phase="profiled: GPU kernel time", us=1e3 * busy / it))
        rows.append(dict(constraints=label, phase="profiled: wall", us=1e6 * wall / it))
        for e in sorted(kernels, key=lambda e: -e.device_time_total)[:6]:
            rows.append(dict(constraints=label, phase=f"  kernel {e.key[:70]}", us=e.device_time_total / it))
        while eng.has_unfinished_requests():
            eng.step()
    dev = device_name(args.device)
    path = write_json(f"profile_structured_{slug(dev)}", dict(device=dev, model=args.model, batch=args.batch,
                                                               rows=rows))
    print_table(rows, ["constraints", "phase", "us"])
    print(f"json: {path}")


# ---- launch: host cost of launches and small copies -------------------------------------------------------

def per_call_us(fn, n: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t) / n


def cmd_launch(args) -> None:
    """Host cost of the launches in a grammar iteration, with the GPU idle and with it busy (a long kernel ahead
    in the stream, as when a forward is in flight): does a launch or a small host-to-device copy wait?"""
    from engine import SamplingParams
    from engine.kernels.sampling import gumbel_sample
    from engine.kernels.token_bitmask import apply_token_bitmask
    from engine.sample.sampler import SampleRow, sample_on_device
    from engine.worker.host_copy import HostCopy
    B, V, dev = args.batch, 49152, torch.device("cuda")
    logits = torch.randn(B, V, device=dev)
    temp = torch.ones(B, device=dev)
    words = (V + 31) // 32
    packed_host = torch.full((B * words + B,), -1, dtype=torch.int32, pin_memory=True)
    packed_host[B * words:] = torch.arange(B, dtype=torch.int32)
    ids = torch.zeros(B, dtype=torch.int64, device=dev)
    static = torch.zeros(B, dtype=torch.int64, device=dev)
    rows32 = [SampleRow(SamplingParams(temperature=1.0, max_tokens=16), [], 8, 0) for _ in range(B)]
    calls = {
        "sample_on_device (engine sampler)": lambda: sample_on_device(logits, rows32, None, True),
        "small list -> device (pageable)": lambda: torch.tensor([1.0] * B).to(dev, non_blocking=True),
        "small list -> device (pinned)": lambda: torch.tensor([1.0] * B, pin_memory=True).to(dev, non_blocking=True),
        "mask rows -> device (pinned, 196 KB)": lambda: packed_host.to(dev, non_blocking=True),
        "apply_token_bitmask (Triton)": lambda: apply_token_bitmask(
            logits, packed_host.to(dev, non_blocking=True)[:B * words].view(B, words),
            packed_host.to(dev, non_blocking=True)[B * words:]),
        "gumbel_sample (Triton + 3 torch ops)": lambda: gumbel_sample(logits, temp, 1234),
        "HostCopy(tokens)": lambda: HostCopy(ids),
        "torch copy_ into a static buffer": lambda: static.copy_(ids),
        "torch.empty on device": lambda: torch.empty(B, V, device=dev),
    }
    for fn in calls.values():                       # compile, warm the allocators
        fn()
    sync()
    rows = []
    for busy in (False, True):
        for name, fn in calls.items():
            if busy:
                torch.cuda._sleep(int(2e8))         # ~100 ms of GPU time ahead of the calls
            rows.append(dict(gpu="busy" if busy else "idle", call=name, us=per_call_us(fn)))
            sync()
    name = device_name()
    path = write_json(f"probe_launch_cost_{slug(name)}", dict(device=name, batch=B, rows=rows))
    print_table(rows, ["gpu", "call", "us"])
    print(f"json: {path}")


# ---- spec-steps / spec-times: a speculative engine's steps ------------------------------------------------

class StepCounter:
    """Counts one engine's steps by kind from its events, and the multi-step blocks launched cold."""

    def __init__(self, eng):
        self.c = dict(block_iters=0, blocks=0, cold_blocks=0, plain_steps=0, verify_steps=0, draft_tokens=0,
                      accepted=0, prefill_steps=0)
        eng.events.subscribe(self.on_event)
        launch = eng.multi_step.launch

        def counted(K, ahead=None, sample=True):
            if ahead is None:
                self.c["cold_blocks"] += 1
            return launch(K, ahead, sample)
        eng.multi_step.launch = counted

    def on_event(self, ev):
        if not hasattr(ev, "num_decode_steps"):
            return
        c = self.c
        if ev.num_decode_steps > 1:
            c["blocks"] += 1
            c["block_iters"] += ev.num_decode_steps
        elif ev.num_prefill_tokens:
            c["prefill_steps"] += 1
        elif ev.spec and ev.spec.get("num_draft_tokens"):
            c["verify_steps"] += 1
            c["draft_tokens"] += ev.spec["num_draft_tokens"]
            c["accepted"] += ev.spec["num_accepted_tokens"]
        elif ev.num_decode_tokens:
            c["plain_steps"] += 1


def cmd_spec_steps(args) -> None:
    """On a GPU a small model's decode is pipelined: multi-step blocks launched back to back, the next queued
    behind the one in flight. Every step that is not such a block costs about a host round trip (a plain single
    step, a verify step), and every block launched with nothing in flight ("cold") restarts the pipeline. This
    runs bench_spec's workloads on the CPU with num_scheduler_steps as on the GPU and counts, per method: decode
    iterations inside blocks, cold blocks, plain steps, verify steps (and their drafts), and whether the greedy
    output equals plain decoding's."""
    from engine import LLM, SamplingParams
    if args.cost_ratio is not None:
        from engine.spec.base import Drafter
        Drafter.cost_ratio = lambda self, batch, k: args.cost_ratio
    torch.set_num_threads(args.threads)
    over = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v) if v != "None" else None
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    methods = args.methods.split(",")
    rows, base_toks, engines = [], {}, {}
    for method in methods:
        base, flags = method.split("+")[0], method.split("+")[1:]
        if base not in engines:
            cfg = {} if base == "none" else dict(NGRAM, **over)
            if base != "none" and any("long" in m.split("+")[1:] for m in methods):
                cfg.setdefault("num_speculative_tokens_max", args.k_long)
            llm = LLM(model=args.model, device="cpu", cpu_kv_cache_gib=0.25, max_model_len=2048, max_num_seqs=16,
                      num_scheduler_steps=args.num_scheduler_steps, **cfg)
            engines[base] = (llm, StepCounter(llm.engine))
        llm, cnt = engines[base]
        eng = llm.engine
        switch_drafter(eng, flags + (["long"] if over.get("num_speculative_tokens_max") else []))
        for wl in args.workloads.split(","):
            texts = [eng.apply_chat_template([{"role": "user", "content": p}]) for p in WORKLOADS[wl]]
            for mode in args.modes.split(","):
                for k in cnt.c:
                    cnt.c[k] = 0
                if mode == "b1":
                    outs = [llm.generate([t], sp, use_tqdm=False)[0] for t in texts[:4]]
                else:
                    n = int(mode[1:])
                    outs = llm.generate([texts[i % len(texts)] for i in range(n)], sp, use_tqdm=False)
                toks = [o.token_ids for o in outs]
                if method == "none":
                    base_toks[(wl, mode)] = toks
                row = dict(workload=wl, mode=mode, method=method, out_tokens=sum(map(len, toks)), **cnt.c,
                           identical=toks == base_toks.get((wl, mode)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    for llm, _ in engines.values():
        llm.engine.close()
    print_table(rows, ["workload", "mode", "method", "out_tokens", "blocks", "block_iters", "cold_blocks",
                       "plain_steps", "verify_steps", "draft_tokens", "accepted", "identical"])
    write_json(f"spec_steps{args.tag}", dict(device=device_name("cpu"), args=vars(args), rows=rows))


STEP_KINDS = ("prefill", "cold", "block", "verify", "plain", "empty")


class StepClock:
    """Times every engine.step() of one engine and classes it: prefill (computed prompt tokens), cold (a
    multi-step block launched with nothing in flight, timed with the step that waits for it), block (a
    pipelined block step), verify (drafts), plain (a synced single decode step without drafts); and the host
    time of the drafter's propose and shadow_probe calls (already inside the steps' times)."""

    def __init__(self, eng):
        self.eng, self.kind = eng, None
        self.ms: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        step, ms_step, process = eng.step, eng._block_step, eng._process_outputs

        def timed_step():
            self.kind = None
            t = time.perf_counter()
            out = step()
            self._add(self.kind or "empty", time.perf_counter() - t)
            return out

        def block_step(K, observe, timer):
            if self.kind is None:
                self.kind = "cold" if eng.multi_step.inflight is None else "block"
            return ms_step(K, observe, timer)

        def process_outputs(sched, toks, lp):
            if self.kind is None:
                if any(sched.num_spec_tokens):
                    self.kind = "verify"
                elif any(c < s.num_prompt_tokens for s, c in zip(sched.seqs, sched.computed_before)):
                    self.kind = "prefill"
                else:
                    self.kind = "plain"
            return process(sched, toks, lp)
        eng.step, eng._block_step, eng._process_outputs = timed_step, block_step, process_outputs
        d = eng.drafter
        if d is not None:
            for name in ("propose", "shadow_probe"):
                fn = getattr(d, name)

                def wrapped(*a, fn=fn, name=name):
                    t = time.perf_counter()
                    r = fn(*a)
                    self.ms[name] += 1e3 * (time.perf_counter() - t)
                    self.n[name] += 1
                    return r
                setattr(d, name, wrapped)

    def _add(self, kind: str, s: float) -> None:
        self.ms[kind] += 1e3 * s
        self.n[kind] += 1

    def reset(self) -> None:
        self.ms.clear()
        self.n.clear()


def cmd_spec_times(args) -> None:
    """bench_spec's workloads (token prompts for tokenizer-less dummy models) with `none` and n-gram engines,
    every step timed and classed (StepClock); `other` = generate()'s wall time minus all its steps; mean TTFT
    and TPOT. The fastest of --reps rounds is kept per (workload, mode, method)."""
    from engine import LLM, SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines, clocks = {}, {}
    for m in args.methods.split(","):
        base = m.split("+")[0]
        if base not in engines:
            llm = LLM(model=args.model, device=args.device, dtype=args.dtype, cpu_kv_cache_gib=0.25,
                      max_model_len=2048, gpu_memory_utilization=0.3, max_num_seqs=16,
                      **({} if base == "none" else NGRAM))
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)
            engines[base], clocks[base] = llm, StepClock(llm.engine)
    best = {}
    for wl in args.workloads.split(","):
        for mode in args.modes.split(","):
            for _ in range(args.reps):
                for m in args.methods.split(","):
                    base = m.split("+")[0]
                    llm, clock = engines[base], clocks[base]
                    switch_drafter(llm.engine, m.split("+")[1:])
                    clock.reset()
                    outs, wall = run_mode(llm, WORKLOADS[wl], mode, sp)
                    ntok = sum(len(o.token_ids) for o in outs)
                    row = dict(workload=wl, mode=mode, method=m, tok_s=ntok / wall, wall_ms=1e3 * wall,
                               ttft_ms=1e3 * sum(o.ttft or 0 for o in outs) / len(outs),
                               tpot_ms=1e3 * sum(o.tpot or 0 for o in outs) / len(outs))
                    for k in STEP_KINDS:
                        row[f"{k}_n"], row[f"{k}_ms"] = clock.n.get(k, 0), clock.ms.get(k, 0.0)
                    row["other_ms"] = row["wall_ms"] - sum(clock.ms.get(k, 0.0) for k in STEP_KINDS)
                    for k in ("propose", "shadow_probe"):
                        row[f"{k}_ms"] = clock.ms.get(k, 0.0)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                          flush=True)
                    key = (wl, mode, m)
                    if key not in best or row["tok_s"] > best[key]["tok_s"]:
                        best[key] = row
    rows = list(best.values())
    for r in rows:
        b = best.get((r["workload"], r["mode"], "none"))
        r["speedup"] = r["tok_s"] / b["tok_s"] if b else None
    dev = device_name(args.device)
    print_table(rows, ["workload", "mode", "method", "tok_s", "speedup", "ttft_ms", "tpot_ms", "prefill_ms",
                       "cold_n", "cold_ms", "block_n", "block_ms", "verify_n", "verify_ms", "plain_n", "plain_ms",
                       "other_ms", "propose_ms", "shadow_probe_ms"])
    write_json(f"spec_step_times_{slug(dev)}{args.tag}", dict(device=dev, args=vars(args), rows=rows))


# ---- the command line -------------------------------------------------------------------------------------

SPEC_FLAGS = ("method flags as bench_spec.py's: +noshadow, +long, +main, +everyblock / +noeveryblock, "
              "+confirm / +noconfirm, +prefetch / +noprefetch")


# ---- host: the engine process's host work for one decode iteration -------------------------------------------

def cmd_host(args) -> None:
    """One decode iteration of `batch` requests, `out_len` tokens into their outputs, phase by phase on the host:
    planning the block (scheduler), packing its inputs (MultiStepDecoder._prepare), processing its tokens
    (OutputProcessor: stop checks, detokenization, outputs) and encoding them for the API servers (core_proc). The
    tokens are drawn at random from the tokenizer's vocabulary; no forward runs, so any device measures its host."""
    import marshal
    import random
    import statistics
    from engine import LLMEngine, SamplingParams
    from engine.runtime.core_proc import encode_output
    eng = LLMEngine(model=args.model, device="cpu", max_num_seqs=max(args.batch, 8), max_model_len=1024,
                    max_num_batched_tokens=max(2048, 16 * args.batch), num_scheduler_steps=2,
                    skip_tokenizer_init=args.skip_tokenizer_init)
    rng = random.Random(0)
    vocab = eng.detok.vocab_limit or 32000          # (no tokenizer: ids as the tokenizer's would be)
    for _ in range(args.batch):
        eng.add_request([rng.randrange(vocab) for _ in range(16)],
                        SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0))
    sch, op, ms = eng.scheduler, eng.output_processor, eng.multi_step
    op.delta_outputs = args.outputs == "delta"      # as the engine process (core_proc.CoreLoop) runs it
    sched = sch.schedule()                     # the prompts, computed without a forward
    op.process(sched, [[rng.randrange(vocab)] for _ in sched.seqs], [None] * len(sched.seqs))
    for _ in range(args.out_len):
        sched = sch.schedule()
        op.process(sched, [[rng.randrange(vocab)] for _ in sched.seqs], [None] * len(sched.seqs))
    phases = defaultdict(list)
    for _ in range(args.reps):
        t0 = time.perf_counter()
        seqs = list(sch.running)
        blk = sch.schedule_block(seqs, 1, [0] * len(seqs))
        t1 = time.perf_counter()
        ms._prepare(blk, 1)
        t2 = time.perf_counter()
        outs, _, _ = op.process(blk, [[rng.randrange(vocab)] for _ in blk.seqs], [None] * len(blk.seqs))
        t3 = time.perf_counter()
        enc = [encode_output(o, 0, False) for o in outs]
        t4 = time.perf_counter()
        marshal.dumps(("out", enc, {}))
        t5 = time.perf_counter()
        for k, a, b in (("schedule", t0, t1), ("prepare", t1, t2), ("process outputs", t2, t3),
                        ("encode", t3, t4), ("marshal", t4, t5), ("total", t0, t5)):
            phases[k].append(b - a)
    n = len(sch.running)
    rows = [dict(phase=k, ms=1e3 * statistics.median(v), us_per_request=1e6 * statistics.median(v) / n,
                 us_per_request_min=1e6 * min(v) / n) for k, v in phases.items()]
    print(f"{n} requests decoding, {sch.running[0].num_output_tokens} tokens into their outputs; median (and "
          f"least) of {args.reps} iterations")
    print_table(rows, ["phase", "ms", "us_per_request", "us_per_request_min"])
    cpu = device_name("cpu")
    write_json(f"profile_host_{slug(cpu)}{'_notok' if args.skip_tokenizer_init else ''}"
               f"{'_cumulative' if args.outputs == 'cumulative' else ''}",
               dict(cpu=cpu, batch=n, out_len=args.out_len, model=args.model, outputs=args.outputs,
                    skip_tokenizer_init=args.skip_tokenizer_init, rows=rows))
    eng.close()


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python benchmarks/profiler.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{kernels,decode,steps,tiers,structured,launch,"
                                                               "spec-steps,spec-times}")

    p = sub.add_parser("kernels", help="a whole offline run's GPU time per kernel, kvscope or vLLM")
    p.add_argument("--engine", choices=["kvscope", "vllm"], default="kvscope")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--workload", choices=["nano", "prefill", "longctx", "decode", "burst"], default="nano",
                   help="longctx: nano's outputs after 2-4k-token prompts (bench_gpu.py --sections longctx); burst: "
                        "the serving suite's burst (input 512 / output 256 ±50%%) with each server's settings")
    p.add_argument("--requests", type=int, default=0,
                   help="default: 256 (nano) / 128 (prefill) / 200 (longctx) / 64 (decode) / 512 (burst)")
    p.add_argument("--quantization", default="", help="fp8 etc. (both engines)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="both engines")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help="kvscope: an EngineConfig field, e.g. --set fp8_activations=false (repeatable)")
    p.set_defaults(fn=cmd_kernels)

    p = sub.add_parser("decode", help="one batch-1 decode step's kernels against the HBM floor")
    p.add_argument("--shape", default="llama-3.2-1b", help="a dummy preset")
    p.add_argument("--steps", type=int, default=8, help="num_scheduler_steps")
    p.add_argument("--gemv", type=int, default=None, help="gemv_max_tokens (default: the engine's)")
    p.add_argument("--pdl", type=int, default=1, help="enable_pdl (0: kernel times not stretched by early starts)")
    p.add_argument("--gemv-table", default="", help="a sweep_gemv.py --table-out JSON merged into the tuned tables")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (rank 0's kernels are profiled)")
    p.set_defaults(fn=cmd_decode)

    p = sub.add_parser("steps", help="a throughput run's steps by kind, from the engine's step events")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--configs", default="default,nochunk", help=f"comma-separated, of {list(STEP_CONFIGS)}")
    p.add_argument("--torch-profile", default="", help="engine steps to run under torch.profiler, e.g. 3,300")
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.set_defaults(fn=cmd_steps)

    p = sub.add_parser("tiers", help="the multi-turn workload with and without the host tier: TTFT, copies, kernels")
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--offload-gib", type=float, default=2.0)
    p.add_argument("--torch-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="also a run under torch.profiler per config (its kernel and host-op tables)")
    p.add_argument("--copy-blocks", type=int, default=52, help="blocks per call in the copy-rate table (a turn's "
                   "prefix on the 1B default)")
    p.set_defaults(fn=cmd_tiers)

    p = sub.add_parser("structured", help="a constrained decode iteration's host phases and GPU busy time")
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run, host timers only")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tokenizer-dir", type=Path, default=None)
    p.add_argument("--mask-threads", type=int, nargs="+", default=[0])
    p.add_argument("--feed", nargs="+", default=["seq"], choices=["seq", "par"])
    p.add_argument("--pin", type=int, nargs="+", default=[0], choices=[0, 1])
    p.set_defaults(fn=cmd_structured)

    p = sub.add_parser("launch", help="host cost of a grammar iteration's launches, GPU idle vs busy")
    p.add_argument("--batch", type=int, default=32)
    p.set_defaults(fn=cmd_launch)

    p = sub.add_parser("host", help="the engine's host work for one decode iteration of a large batch, by phase")
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--out-len", type=int, default=200)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: no detokenization")
    p.add_argument("--outputs", choices=["delta", "cumulative"], default="delta",
                   help="delta: each output carries its step's tokens alone, as in the engine process; cumulative: "
                        "all tokens so far, as LLMEngine.step's callers get them")
    p.set_defaults(fn=cmd_host)

    p = sub.add_parser("spec-steps", help="CPU: the kinds of steps a speculative engine takes")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--methods", default="none,ngram", help=SPEC_FLAGS)
    p.add_argument("--workloads", default="chat,rewrite")
    p.add_argument("--modes", default="b1,b8")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-scheduler-steps", type=int, default=8)
    p.add_argument("--set", action="append", default=[], help="FIELD=VALUE for the speculative engines")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost-ratio", type=float, default=None,
                   help="fix auto-off's verify/plain cost ratio (the CPU's own measured ratio is far above a GPU's)")
    p.add_argument("--k-long", type=int, default=8, help="'+long': num_speculative_tokens_max")
    p.add_argument("--tag", default="")
    p.set_defaults(fn=cmd_spec_steps)

    p = sub.add_parser("spec-times", help="every step of a speculative engine timed and classed")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--methods", default="none,ngram", help=SPEC_FLAGS)
    p.add_argument("--modes", default="b1,b8")
    p.add_argument("--workloads", default="rewrite,chat")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tag", default="")
    p.set_defaults(fn=cmd_spec_times)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    args.__dict__.pop("fn")(args)


if __name__ == "__main__":
    main()
