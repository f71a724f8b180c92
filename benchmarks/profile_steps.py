"""Where does a throughput run spend its steps? Runs nano-vllm's workload under a few configs with an
event listener and summarizes the engine's own StepEvents by step kind (the inspector's data, as a table).

    python benchmarks/profile_steps.py [--requests 256] [--configs default,nochunk] [--model dummy:llama-3.1-8b]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_gpu import MODEL, nano_workload  # noqa: E402
from benchmarks.common import print_table  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

CONFIGS = {"default": {}, "nochunk": dict(enable_chunked_prefill=False), "budget4k": dict(max_num_batched_tokens=4096),
           "nographs": dict(enable_cuda_graphs=False), "single": dict(num_scheduler_steps=1),
           "multi4": dict(num_scheduler_steps=4), "multi16": dict(num_scheduler_steps=16)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--configs", default="default,nochunk")
    ap.add_argument("--torch-profile", default="", help="engine steps to run under torch.profiler, e.g. 3,300")
    ap.add_argument("--model", default=MODEL, help="e.g. dummy:llama-3.1-8b")
    args = ap.parse_args()
    prof_steps = {int(s) for s in args.torch_profile.split(",") if s}
    profiles = []
    prompts, outs = nano_workload(args.requests)
    rows = []
    for name in args.configs.split(","):
        cfg = {**dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384,
                      enable_step_timings=False), **CONFIGS[name]}
        llm = LLM(args.model, **cfg)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)
        events = []
        eng = llm.engine
        step0 = eng.step_index

        def listen(e):
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
        torch.cuda.synchronize()
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
        llm.engine.close()
        print(rows[-1], flush=True)
    for name, step, batch, npre, wall, prof in profiles:
        print(f"\n== {name}: step {step}, {batch} seqs, {npre} prefill tokens, {wall * 1e3:.2f} ms wall (profiled)")
        dev_total = sum(r["device_time_ms"] for r in prof if not r["name"].startswith(("ProfilerStep", "aten::")))
        print(f"   device kernels total (top 40, excl. aten wrappers) {dev_total:.2f} ms")
        for r in prof[:25]:
            print(f"   {r['device_time_ms']:8.3f} ms dev {r['cpu_time_ms']:8.3f} ms cpu x{r['count']:<4} {r['name'][:90]}")
    print_table(rows, ["config", "kind", "steps", "total_s", "step_ms", "batch", "tokens", "schedule", "prepare",
                       "forward", "sampling", "postprocess"])


if __name__ == "__main__":
    main()
