"""Where does a constrained decode iteration's host time go? (issue 13) A batch of B requests constrained to
bench_structured's JSON schema decodes in grammar blocks; each phase of `multi_step.sample_grammar_block`'s
loop is wrapped with a host timer, and the GPU's busy time per iteration comes from torch.profiler. The GPU
idles whenever the host chain (wait for the last tokens, feed the grammars, fill and apply the masks, launch
the sampler and the next forward) outlasts the forward in flight.

    python benchmarks/profile_structured.py [--batch 32] [--model dummy:llama-3.2-1b] [--tokenizer-dir DIR]
        [--mask-threads 0 2 4] [--feed seq par] [--pin 0 1]

--mask-threads: EngineConfig.structured_mask_threads per constrained run (0: llguidance's default); --feed par
feeds the sampled tokens to the grammars through llguidance's parallel consume_token_par instead; --pin 1
copies the sampler's small host lists from pinned memory (a pageable copy may wait for the stream).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_structured import PROMPT, SCHEMA, install_tokenizer  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from engine import LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402
from engine.worker import multi_step
from engine.worker.host_copy import HostCopy  # noqa: E402


def timed(spent: dict, key: str, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[key] += time.perf_counter() - t
    return wrapper


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(eng: LLMEngine, B: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:llama-3.2-1b")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script, host timers only")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tokenizer-dir", type=Path, default=None)
    ap.add_argument("--mask-threads", type=int, nargs="+", default=[0])
    ap.add_argument("--feed", nargs="+", default=["seq"], choices=["seq", "par"])
    ap.add_argument("--pin", type=int, nargs="+", default=[0], choices=[0, 1])
    args = ap.parse_args()
    if args.tokenizer_dir is not None:
        install_tokenizer(args.tokenizer_dir)
    cpu = args.device == "cpu"
    eng = LLMEngine(model=args.model, device=args.device, max_num_seqs=args.batch, enable_prefix_caching=False,
                    **(dict(structured_overlap=True, num_scheduler_steps=4, cpu_kv_cache_gib=0.25) if cpu else {}))
    spent: dict[str, float] = defaultdict(float)
    feed_seq, mode = multi_step.feed_grammars, {"feed": "seq"}

    def feed_par(seqs, tokens):
        live = [(s, t) for s, t in zip(seqs, tokens) if s.matcher is not None and not s.is_finished
                and not (s.matcher.is_stopped() or s.matcher.is_error())]
        oks = eng.token_bitmask.executor.consume_token_par([(s.matcher, t) for s, t in live])
        for (s, _), ok in zip(live, oks):
            m = s.matcher
            s.grammar_ahead.append((("stop" if m.is_stopped() else None), None) if ok
                                   else ("stop", f"grammar error: {m.get_error()}"))
    feed = {"seq": feed_seq, "par": feed_par}
    multi_step.feed_grammars = timed(spent, "feed grammars", lambda *a: feed[mode["feed"]](*a))
    multi_step.sample_on_device = timed(spent, "sample (launch)", multi_step.sample_on_device)
    eng._apply_grammars = timed(spent, "fill + apply masks", eng._apply_grammars)
    eng.runner.execute = timed(spent, "forward (launch)", eng.runner.execute)
    HostCopy.tolist = timed(spent, "wait for tokens", HostCopy.tolist)
    multi_step.sample_grammar_block = timed(spent, "grammar block (all)", multi_step.sample_grammar_block)
    run(eng, 2, 8, True)                            # compile the grammar, warm up
    rows = []
    from engine.sample import sampler
    to_dev = {0: sampler._to_dev,
              1: lambda v, device, dtype=None: torch.tensor(v, dtype=dtype, pin_memory=device.type == "cuda").to(
                  device, non_blocking=True)}
    runs = [(False, None, "seq", 0)] + [(True, n or None, f, p) for n in args.mask_threads for f in args.feed
                                        for p in args.pin]
    for constrained, threads, mode["feed"], pin in runs:
        eng.config, eng.token_bitmask = eng.config.replace(structured_mask_threads=threads), None
        sampler._to_dev = to_dev[pin]
        label = (f"on, {threads or 'default'} threads, feed {mode['feed']}{', pinned' if pin else ''}"
                 if constrained else "off")
        for k in list(spent):
            spent[k] = 0.0
        dt, iters = run(eng, args.batch, args.max_tokens, constrained)
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        rows.append(dict(constraints=label, phase="wall per iteration",
                         us=1e6 * dt / max(iters, 1)))
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
        torch.cuda.synchronize()
        n0 = sum(s.num_output_tokens for s in eng.scheduler.running)
        t = time.perf_counter()
        with prof:
            for _ in range(6):
                eng.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
        it = max(1, (sum(s.num_output_tokens for s in eng.scheduler.running) - n0) // args.batch)
        kernels = [e for e in prof.key_averages() if e.device_time_total
                   and not e.key.startswith(("aten::", "cuda", "Activity", "ProfilerStep"))]
        busy = sum(e.device_time_total for e in kernels) / 1e3                                  # ms
        rows.append(dict(constraints=label, phase="profiled: GPU kernel time",
                         us=1e3 * busy / it))
        rows.append(dict(constraints=label, phase="profiled: wall", us=1e6 * wall / it))
        top = sorted(kernels, key=lambda e: -e.device_time_total)
        for e in top[:6]:
            rows.append(dict(constraints=label, phase=f"  kernel {e.key[:70]}",
                             us=e.device_time_total / it))
        while eng.has_unfinished_requests():
            eng.step()
    path = write_json("profile_structured", dict(model=args.model, batch=args.batch, rows=rows))
    print_table(rows, ["constraints", "phase", "us"])
    print(f"json: {path}")


if __name__ == "__main__":
    main()
