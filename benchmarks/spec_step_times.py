"""Where a speculative engine's extra time goes, step by step, against plain decoding (any device).

Runs bench_spec's workloads (token prompts for tokenizer-less dummy models) with `none` and n-gram engines
and times every `engine.step()` call, grouped by what the step was:

  prefill     a step that computed prompt tokens
  cold        a multi-step block launched with nothing in flight (a pipeline start), timed with the step
              that waits for it
  block       a pipelined block step (its launch behind the one in flight + the wait for that one)
  verify      a verify step (drafts)
  plain       a synced single decode step without drafts
and, outside the steps, the host time of the drafter's propose and shadow_probe calls (already inside the
steps' times) and `other`: generate()'s wall time minus all its steps. Also mean TTFT and TPOT.

    python benchmarks/spec_step_times.py --device cuda --dtype bfloat16 --model dummy:llama-3.2-1b --modes b1,b8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.bench_spec import WORKLOADS, run_mode, set_shadow_flags  # noqa: E402
from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.worker import multi_step

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4)


class StepClock:
    """Times every engine.step() of one engine and classifies it."""

    def __init__(self, eng):
        self.eng, self.kind = eng, None
        self.ms: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        step, ms_step, post = eng.step, multi_step.step, eng._postprocess

        def timed_step():
            self.kind = None
            t = time.perf_counter()
            out = step()
            self._add(self.kind or "empty", time.perf_counter() - t)
            return out

        def block_step(engine, K, observe, timer):
            if engine is eng and self.kind is None:
                self.kind = "cold" if engine._inflight is None else "block"
            return ms_step(engine, K, observe, timer)

        def postprocess(sched, mask, toks, lp):
            if self.kind is None:
                if any(sched.num_spec_tokens):
                    self.kind = "verify"
                elif any(c < s.num_prompt_tokens for s, c in zip(sched.seqs, sched.computed_before)):
                    self.kind = "prefill"
                else:
                    self.kind = "plain"
            return post(sched, mask, toks, lp)
        eng.step, eng._postprocess = timed_step, postprocess
        multi_step.step = block_step
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--methods", default="none,ngram", help="flags as bench_spec.py's: +noshadow, +main, "
                    "+everyblock / +noeveryblock, +confirm / +noconfirm, +prefetch / +noprefetch")
    ap.add_argument("--modes", default="b1,b8")
    ap.add_argument("--workloads", default="rewrite,chat")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
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
            for rep in range(args.reps):
                for m in args.methods.split(","):
                    base, flags = m.split("+")[0], m.split("+")[1:]
                    llm, clock = engines[base], clocks[base]
                    d = llm.engine.drafter
                    if d is not None:
                        d.shadow_probes = d.supports_shadow and "noshadow" not in flags
                        set_shadow_flags(d, flags)
                    clock.reset()
                    outs, wall = run_mode(llm, WORKLOADS[wl], mode, sp)
                    ntok = sum(len(o.token_ids) for o in outs)
                    row = dict(workload=wl, mode=mode, method=m, tok_s=ntok / wall, wall_ms=1e3 * wall,
                               ttft_ms=1e3 * sum(o.ttft or 0 for o in outs) / len(outs),
                               tpot_ms=1e3 * sum(o.tpot or 0 for o in outs) / len(outs))
                    steps = 0.0
                    for k in ("prefill", "cold", "block", "verify", "plain", "empty"):
                        row[f"{k}_n"], row[f"{k}_ms"] = clock.n.get(k, 0), clock.ms.get(k, 0.0)
                        steps += clock.ms.get(k, 0.0)
                    row["other_ms"] = row["wall_ms"] - steps
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


if __name__ == "__main__":
    main()
