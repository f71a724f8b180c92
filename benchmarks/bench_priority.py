"""Priority scheduling: a person's chat turns during simulated load, FCFS vs priority.

The *Steady Poisson* load preset runs in-process (inspector.load.LoadRunner, priority 0) on the bundled
model; while it runs, 3 Playground-style chat turns (the model's chat template, the Playground's default
sampling, priority -1 as webui/playground.py sends them under the priority policy) arrive a few seconds
apart. Reports each turn's TTFT (engine stamps: first token - arrival) and the load's own metrics under
`scheduling_policy="fcfs"` and `"priority"`, for each step token budget given (`max_num_batched_tokens`):
a turn that arrives mid-step waits for that step to end, and its own step carries up to the budget in
tokens, so on a CPU the budget bounds what any policy can do.

    python benchmarks/bench_priority.py [--model dummy:NAME] [--device cpu] [--turn-times 3,6,9]
                                        [--max-num-batched-tokens default,2048]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import EngineConfig, SamplingParams  # noqa: E402
from engine.runtime.async_engine import EngineLoop  # noqa: E402
from inspector import load as L  # noqa: E402

PLAYGROUND_PRIORITY = -1      # webui/playground.py's PLAYGROUND_PRIORITY (not imported: no Gradio here)
TURNS = ["What is the capital of France?", "Name three colours of the rainbow.",
         "Write one sentence about cats."]


def run(policy: str, budget: int | None, args) -> dict:
    cfg = EngineConfig(model=args.model, device=args.device, scheduling_policy=policy,
                       max_num_batched_tokens=budget)
    loop = EngineLoop(cfg).start()
    try:
        eng = loop.engine
        spec = L.preset("Steady Poisson", L.EngineInfo.from_loop(loop), seed=args.seed)
        runner = L.LoadRunner(loop, spec).start()
        t0 = runner._t_start
        prio = PLAYGROUND_PRIORITY if policy == "priority" else 0
        sent = []
        for at, text in zip(args.turn_times, TURNS):
            time.sleep(max(0.0, t0 + at - time.perf_counter()))
            prompt = eng.apply_chat_template([{"role": "user", "content": text}])
            # the Playground's default sampling controls (webui/playground.py)
            sp = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=128, priority=prio)
            busy = (len(eng.scheduler.running), len(eng.scheduler.waiting))   # a glance, not under the lock
            sent.append((at, busy, loop.submit(prompt, sp)))
        turns = []
        for at, (running, waiting), stream in sent:
            out = stream.result(timeout=3600)
            m = out.metrics
            turns.append(dict(at_s=at, running=running, waiting=waiting, ttft_s=m.ttft, queue_s=m.queue_time,
                              preemptions=m.num_preemptions, output_tokens=len(out.token_ids)))
        runner.wait()
        s = runner.summary()                    # metrics.summarize: latencies in ms
        load = dict(ttft_p50_s=s["TTFT"]["p50"] / 1e3, ttft_p90_s=s["TTFT"]["p90"] / 1e3,
                    e2el_p50_s=s["E2EL"]["p50"] / 1e3, output_tok_s=s["output_throughput"],
                    completed=s["completed"], failed=s["failed"], preemptions=eng.scheduler.num_preemptions,
                    duration_s=s["duration_s"])
        return dict(policy=policy, max_num_batched_tokens=eng.config.scheduler_config.max_num_batched_tokens, turns=turns,
                    load=load, num_blocks=eng.num_blocks, max_num_seqs=eng.config.scheduler_config.max_num_seqs,
                    loadavg_1min_after=os.getloadavg()[0])   # this run itself keeps ~2 cores busy
    finally:
        loop.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, dummy:<preset>, or empty for the bundled SmolLM2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turn-times", default="3,6,9", help="seconds after the load starts, one per chat turn")
    ap.add_argument("--policies", default="fcfs,priority")
    ap.add_argument("--max-num-batched-tokens", default="default,2048",
                    help="step token budgets to compare, comma-separated ('default': the engine's for the device)")
    args = ap.parse_args(argv)
    args.turn_times = [float(x) for x in args.turn_times.split(",")][:len(TURNS)]
    budgets = [None if x.strip() in ("default", "none", "") else int(x) for x in args.max_num_batched_tokens.split(",")]
    results = [run(p, b, args) for b in budgets for p in args.policies.split(",")]

    rows = [{"budget": r["max_num_batched_tokens"], "policy": r["policy"], "turn": i + 1, "sent at (s)": t["at_s"],
             "running / waiting": f"{t['running']} / {t['waiting']}", "TTFT (s)": t["ttft_s"],
             "queue (s)": t["queue_s"], "preempted": t["preemptions"]}
            for r in results for i, t in enumerate(r["turns"])]
    print("\nPlayground chat turns during the Steady Poisson load (priority -1 under the priority policy)")
    print_table(rows, list(rows[0]))
    print("\nThe simulated load itself (priority 0)")
    load_rows = [{"budget": r["max_num_batched_tokens"], "policy": r["policy"],
                  "TTFT p50 (s)": r["load"]["ttft_p50_s"], "TTFT p90 (s)": r["load"]["ttft_p90_s"],
                  "E2EL p50 (s)": r["load"]["e2el_p50_s"], "output tok/s": r["load"]["output_tok_s"],
                  "completed": r["load"]["completed"], "preemptions": r["load"]["preemptions"]} for r in results]
    print_table(load_rows, list(load_rows[0]))
    dev = device_name(args.device)
    path = write_json(f"priority_{slug(args.model or 'smollm2')}_{slug(dev)}",
                      dict(device=dev, model=args.model or "SmolLM2-135M-Instruct (bundled)",
                           preset="Steady Poisson", seed=args.seed, turn_times_s=args.turn_times,
                           turn_priority=PLAYGROUND_PRIORITY, results=results))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
