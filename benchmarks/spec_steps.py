"""Count what kind of steps a speculative engine takes, against plain decoding, on the CPU.

On a GPU a small model's decode is pipelined: multi-step blocks of num_scheduler_steps iterations are launched
back to back, the next one queued behind the one in flight, with no host round trip per token. Every step that
is not such a block costs roughly a full host round trip (a plain single step, a verify step), and every block
launched with nothing in flight ahead of it ("cold") restarts the pipeline. This script runs the bench_spec
workloads on the CPU with num_scheduler_steps as on the GPU and counts, per method:

  block_iters   decode iterations run inside multi-step blocks
  cold_blocks   blocks launched with no block in flight (a pipeline (re)start)
  plain_steps   single synced decode steps without drafts
  verify_steps  verify steps (and the draft tokens they carried)
  identical     greedy output equal to plain decoding's

    python benchmarks/spec_steps.py [--methods none,ngram] [--workloads chat,rewrite] [--modes b1,b8]

Method flags (one engine per base method, switched per run as bench_spec.py does): "ngram+noshadow" probes by
verify steps (spec_shadow_probes off), "ngram+long" lets drafts grow to --k-long (num_speculative_tokens_max),
"ngram+everyblock" turns spec_shadow_every_block on (shadow replays after every block, no probe gap).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.bench_spec import WORKLOADS, set_shadow_flags  # noqa: E402
from benchmarks.common import print_table, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.worker import multi_step

NGRAM = dict(speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4)


class Counter:
    def __init__(self, eng):
        self.c = dict(block_iters=0, blocks=0, cold_blocks=0, plain_steps=0, verify_steps=0, draft_tokens=0,
                      accepted=0, prefill_steps=0)
        eng.events.subscribe(self.on_event)
        launch = multi_step.launch

        def counted(engine, K, ahead=None, sample=True):
            if engine is eng and ahead is None:
                self.c["cold_blocks"] += 1
            return launch(engine, K, ahead, sample)
        multi_step.launch = counted

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="none,ngram")
    ap.add_argument("--workloads", default="chat,rewrite")
    ap.add_argument("--modes", default="b1,b8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-scheduler-steps", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="FIELD=VALUE for the speculative engines")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cost-ratio", type=float, default=None,
                    help="fix auto-off's verify/plain cost ratio (the CPU's own measured ratio is far above a GPU's)")
    ap.add_argument("--k-long", type=int, default=8, help="'+long': num_speculative_tokens_max")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.cost_ratio is not None:
        from engine.spec.base import Drafter
        Drafter.cost_ratio = lambda self, batch, k: args.cost_ratio
    torch.set_num_threads(args.threads)
    over = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        over[k] = json.loads(v) if v not in ("None",) else None
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    rows, base_toks = [], {}
    engines = {}
    for method in args.methods.split(","):
        base, flags = method.split("+")[0], method.split("+")[1:]
        if base not in engines:
            cfg = {} if base == "none" else dict(NGRAM, **over)
            if base != "none" and any("long" in m.split("+")[1:] for m in args.methods.split(",")):
                cfg.setdefault("num_speculative_tokens_max", args.k_long)
            llm = LLM(model=args.model, device="cpu", cpu_kv_cache_gib=0.25, max_model_len=2048, max_num_seqs=16,
                      num_scheduler_steps=args.num_scheduler_steps, **cfg)
            engines[base] = (llm, Counter(llm.engine))
        llm, cnt = engines[base]
        eng = llm.engine
        d = eng.drafter
        if d is not None:
            d.shadow_probes = eng.config.speculative_config.spec_shadow_probes and d.supports_shadow and "noshadow" not in flags
            set_shadow_flags(d, flags)
            d.k = eng.config.speculative_config.max_speculative_tokens if "long" in flags or over.get("num_speculative_tokens_max") \
                else d.k_base
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
    write_json(f"spec_steps{args.tag}", dict(args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
