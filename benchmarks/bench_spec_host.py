"""Host time of a speculative-decoding step, outside the model forward, measured on the CPU.

On a GPU a small model's verify step is bound by the host: the forward replays a CUDA graph in well under a
millisecond, and what the step costs beyond it is Python (proposal, scheduling, packing, verification,
rollback, output processing). That host code costs the same on this CPU, so this script runs the engine here
with the bundled SmolLM2 (or any model), times every engine step and subtracts the time spent inside the
model's forward and LM head: what is left is the step's host time. Steps are grouped by kind:

  verify    a decode step that verified drafts (n-gram k drafts + 1 per request)
  plain     a decode step of one token per request (no drafts: drafting off, or no drafter)
  block     a multi-step block of K decode iterations (host time reported per iteration)

By default the verify steps go through the CUDA-graph runner's padded (batch, Q) layout run eagerly
(`CudaGraphRunner(capture=False)`), so its packing is counted as on the GPU (its padded forward is not).

    python benchmarks/bench_spec_host.py                       # rewrite + chat, batch 1 and 8
    python benchmarks/bench_spec_host.py --baseline benchmarks/results/spec_host_before.json --tag _after

Writes benchmarks/results/spec_host<tag>.json; with --baseline, the table gains the baseline's host ms per
step for the same (workload, batch, method, kind) and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bench_spec import WORKLOADS, token_prompts  # noqa: E402
from benchmarks.common import device_name, print_table, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4)


def method_config(method: str) -> dict:
    """'none' or 'ngram' with suffixes: '+noauto' (auto-off off), '+general' (spec_fast_verify off)."""
    base, *flags = method.split("+")
    if base == "none":
        return {}
    if base != "ngram" or set(flags) - {"noauto", "general"}:
        raise ValueError(f"--methods: unknown method {method!r}")
    cfg = dict(NGRAM, speculative_auto_off="noauto" not in flags)
    if "general" in flags:
        cfg["spec_fast_verify"] = False
    return cfg


# CPU time of the engine thread, not wall time: on a shared machine other processes' load would otherwise land
# in the host figures (torch runs single-threaded here, so the model's time is on this thread too)
_clock = time.thread_time
_LOGITS_OPS = ("argmax", "index_select", "log_softmax", "softmax", "topk", "sort", "max")


class StepClock:
    """Wraps one engine's step and its model's forward / LM head: per step, wall seconds, device seconds and
    what kind of step it was. Device seconds: the model's forward and LM head, and the reductions / gathers
    over [rows, vocab] logits (argmax, row gathers, softmax...), which on a GPU are kernels costing a launch
    but here run on the CPU for as long as the vocabulary makes them."""

    def __init__(self, eng):
        self.eng = eng
        self.model_s = 0.0
        self._inside = False
        self.sched = None
        self.iters = 1
        # (kind, batch, wall s, model s, output tokens, decode iterations)
        self.records: list[tuple[str, int, float, float, int, int]] = []
        model = eng.runner.model
        fwd, logits = model.forward, model.compute_logits

        vocab = eng.arch_config.vocab_size

        def timed(fn, logits_op=False):
            def call(*a, **kw):
                if self._inside or (logits_op and not (a[0].dim() == 2 and a[0].shape[-1] == vocab)):
                    return fn(*a, **kw)
                self._inside = True
                t = _clock()
                try:
                    return fn(*a, **kw)
                finally:
                    self.model_s += _clock() - t
                    self._inside = False
            return call
        model.forward, model.compute_logits = timed(fwd), timed(logits)
        for name in _LOGITS_OPS:
            setattr(torch.Tensor, name, timed(getattr(torch.Tensor, name), logits_op=True))
        sched_fn = eng.scheduler.schedule

        def schedule():
            self.sched = sched_fn()
            return self.sched
        eng.scheduler.schedule = schedule
        process = eng._process_outputs

        def process_outputs(sched, new_tokens, lp_rows):
            self.iters = max((len(t) for t in new_tokens), default=1)
            return process(sched, new_tokens, lp_rows)
        eng._process_outputs = process_outputs
        step = eng.step

        def timed_step():
            self.model_s, self.sched, self.iters = 0.0, None, 1
            n0 = eng.output_processor.num_generation_tokens
            t = _clock()
            out = step()
            wall = _clock() - t
            toks = eng.output_processor.num_generation_tokens - n0
            kind = self._kind()
            self.records.append((kind, self._batch(), wall, self.model_s, toks, self.iters if kind == "block" else 1))
            return out
        eng.step = timed_step

    def _batch(self) -> int:
        if self.sched is not None:
            return len(self.sched.seqs)
        return len(self.eng.scheduler.running)

    def _kind(self) -> str:
        s = self.sched
        if s is None:                           # no scheduler step: a multi-step block
            return "block"
        if not s.seqs:
            return "empty"
        decode = all(seq.num_output_tokens and n == k + 1 for seq, n, k in
                     zip(s.seqs, s.num_new_tokens, s.num_spec_tokens))
        if not decode:
            return "prefill"
        return "verify" if max(s.num_spec_tokens) else "plain"


def prompts_for(llm: LLM, workload: str, n: int) -> list:
    eng = llm.engine
    texts = WORKLOADS[workload]
    if eng.tokenizer is None or not getattr(eng.tokenizer, "chat_template", None):
        return token_prompts(workload, eng.arch_config.vocab_size, n)
    return [eng.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def run(llm: LLM, clock: StepClock, workload: str, batch: int, max_tokens: int, requests: int):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    clock.records.clear()
    prompts = prompts_for(llm, workload, requests)
    outs = []
    if batch == 1:
        for p in prompts:
            outs += llm.generate([p], sp, use_tqdm=False)
    else:
        for i in range(0, len(prompts), batch):
            outs += llm.generate(prompts[i:i + batch], sp, use_tqdm=False)
    return [o.token_ids for o in outs], list(clock.records)


def summarize(records) -> dict[str, dict]:
    """Per step kind: mean (and median) host ms per decode iteration, model ms, tokens per iteration."""
    agg: dict[str, dict] = defaultdict(lambda: dict(steps=0, iters=0, host_s=0.0, model_s=0.0, tokens=0, batch=0,
                                                    host=[]))
    for kind, batch, wall, model_s, toks, iters in records:
        if kind in ("prefill", "empty"):
            continue
        a = agg[kind]
        a["steps"] += 1
        a["iters"] += iters
        a["host_s"] += wall - model_s
        a["model_s"] += model_s
        a["tokens"] += toks
        a["batch"] += batch
        a["host"].append((wall - model_s) / iters)
    out = {}
    for kind, a in agg.items():
        n, it = a["steps"], a["iters"]
        host = sorted(a["host"])
        out[kind] = dict(steps=n, iters=it, batch=a["batch"] / n, host_ms=1e3 * a["host_s"] / it,
                         host_ms_p50=1e3 * host[n // 2], model_ms=1e3 * a["model_s"] / it,
                         tokens_per_iter=a["tokens"] / it,
                         host_ms_per_token=1e3 * a["host_s"] / max(a["tokens"], 1))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default="rewrite,chat")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--requests", type=int, default=8, help="prompts per (workload, batch)")
    ap.add_argument("--methods", default="none,ngram+noauto,ngram")
    ap.add_argument("--num-scheduler-steps", type=int, default=8, help="as on the GPU (the CPU default is 1)")
    ap.add_argument("--no-graph-layout", action="store_true",
                    help="verify steps without the CUDA-graph runner's padded layout")
    ap.add_argument("--reps", type=int, default=2, help="repetitions; per kind the lowest mean host time is kept")
    ap.add_argument("--baseline", default=None, help="a JSON this script wrote: adds its host ms per step")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for method in args.methods.split(","):
        cfg = dict(method_config(method), num_scheduler_steps=args.num_scheduler_steps)
        llm = LLM(model=args.model, device="cpu", dtype=args.dtype, cpu_kv_cache_gib=0.25, max_model_len=2048,
                  max_num_seqs=max(int(b) for b in args.batches.split(",")), **cfg)
        eng = llm.engine
        if not args.no_graph_layout:
            from engine.worker.cuda_graphs import CudaGraphRunner
            eng.runner.graphs = CudaGraphRunner(eng.runner, eng.config, capture=False)
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)     # warm-up
        clock = StepClock(eng)
        for wl in args.workloads.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                best: dict[str, dict] = {}
                toks_ref = None
                for _ in range(args.reps):
                    toks, records = run(llm, clock, wl, b, args.max_tokens, args.requests)
                    assert toks_ref is None or toks == toks_ref, "outputs changed between repetitions"
                    toks_ref = toks
                    for kind, s in summarize(records).items():
                        if kind not in best or s["host_ms"] < best[kind]["host_ms"]:
                            best[kind] = s
                for kind, s in sorted(best.items()):
                    s["mean_batch"] = s.pop("batch")
                    rows.append(dict(workload=wl, batch=b, method=method, kind=kind, **s,
                                     out_tokens=sum(len(t) for t in toks_ref)))
                    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                          flush=True)
        eng.close()
    cols = ["workload", "batch", "method", "kind", "steps", "iters", "tokens_per_iter", "model_ms", "host_ms",
            "host_ms_p50", "host_ms_per_token"]
    if args.baseline:
        base = json.loads(open(args.baseline).read())
        index = {(r["workload"], r["batch"], r["method"], r["kind"]): r for r in base["rows"]}
        for r in rows:
            b = index.get((r["workload"], r["batch"], r["method"], r["kind"]))
            if b is not None:
                r["before_host_ms"] = b["host_ms"]
                r["before_host_ms_p50"] = b["host_ms_p50"]
                r["host_ratio_p50"] = r["host_ms_p50"] / b["host_ms_p50"]
        cols += ["before_host_ms", "before_host_ms_p50", "host_ratio_p50"]
    dev = device_name("cpu")
    payload = dict(device=dev, model=args.model or "SmolLM2-135M-Instruct (bundled)", dtype=args.dtype,
                   loadavg=os.getloadavg(), args=vars(args), rows=rows)
    path = write_json(f"spec_host{args.tag}", payload)
    print()
    print_table(rows, cols)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
