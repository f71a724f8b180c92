"""FP8 KV cache vs full-precision KV: greedy agreement and per-token KL on held-out prompts.

The same model and weights run twice, once with the KV cache in the model's dtype and once with
kv_cache_dtype="fp8"; each of N chat prompts (the bundled text set: every task with its passages, templated)
decodes max_tokens greedy tokens. Reports the share of prompts whose tokens agree exactly, the mean share of
tokens before the first divergence, and the per-token KL(full || fp8) over the full-precision run's top-20
tokens (a token missing from the fp8 run's top-20 takes its 20th logprob), at positions where both runs have
generated the same tokens so far. Then, teacher-forced, each engine reads every prompt followed by the
reference's tokens in one prefill (whose attention reads the chunk's own keys and values from the cache, in the
cache's format) and reports how often its greedy choice at a position is the reference's token: per position,
and the share of prompts where it is at all 64. The reference engine's own figure there is the method's floor
(a prefill's arithmetic is not a decode step's).

    python benchmarks/check_kv_fp8.py [--device cpu|cuda] [--model PATH] [--num-prompts 64] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLMEngine, SamplingParams  # noqa: E402
from inspector.load.text import text_set  # noqa: E402

TOP = 20


def held_out_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    d = text_set()
    out = []
    for i in range(n):
        task, passage = d["tasks"][i % len(d["tasks"])], d["passages"][(i * 7) % len(d["passages"])]
        text = f"{task}\n\n{passage}"
        if i % 3 == 2:
            text += "\n\n" + d["questions"][i % len(d["questions"])]
        out.append(engine.tokenize(engine.apply_chat_template([{"role": "user", "content": text}])))
    return out


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Every prompt with params, stepped to the end -> the final outputs in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list:
    return generate(engine, prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                    logprobs=TOP))


def teacher_forced(engine: LLMEngine, prompts: list[list[int]], ref_outs: list) -> list[list[bool]]:
    """Per prompt, whether engine's greedy token equals the reference's at each generated position, every
    position given the reference's tokens before it."""
    outs = generate(engine, [p + list(r.token_ids[:-1]) for p, r in zip(prompts, ref_outs)],
                    SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    hits = []
    for o, p, r in zip(outs, prompts, ref_outs):
        ranks = [lp[0].rank for lp in o.prompt_logprobs[len(p):]]        # the reference's tokens 0..n-2
        hits.append([k == 1 for k in ranks] + [o.token_ids[0] == r.token_ids[-1]])
    return hits


def forced_stats(hits: list[list[bool]]) -> dict:
    n = sum(map(len, hits))
    return dict(positions_pct=100.0 * sum(map(sum, hits)) / n, prompts_pct=100.0 * sum(map(all, hits)) / len(hits))


def top_kl(ref: list, new: list) -> float:
    """KL(ref || new) over ref's top tokens; ref / new: [chosen, top-n...] Logprobs of one position."""
    lp_new = {x.token_id: x.logprob for x in new[1:]}
    floor = min(lp_new.values())
    kl = 0.0
    for x in ref[1:]:
        kl += math.exp(x.logprob) * (x.logprob - lp_new.get(x.token_id, floor))
    return kl


def compare(ref_outs: list, fp8_outs: list) -> dict:
    agree, prefix, kls = 0, [], []
    for r, f in zip(ref_outs, fp8_outs):
        n = len(r.token_ids)
        same = next((i for i in range(n) if r.token_ids[i] != f.token_ids[i]), n)
        agree += same == n
        prefix.append(same / n)
        kls.extend(top_kl(r.logprobs[i], f.logprobs[i]) for i in range(min(same + 1, n)))
    kls.sort()
    return dict(prompts=len(ref_outs), agree=agree, agree_pct=100.0 * agree / len(ref_outs),
                mean_agree_prefix_pct=100.0 * sum(prefix) / len(prefix), kl_mean=sum(kls) / len(kls),
                kl_p99=kls[min(len(kls) - 1, int(0.99 * len(kls)))], kl_max=kls[-1], kl_positions=len(kls))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or dummy:NAME; default: the bundled SmolLM2-135M")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    outs, blocks, forced = {}, {}, {}
    for kv in ("auto", "fp8"):
        eng = LLMEngine(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=kv,
                        max_model_len=1024, enable_prefix_caching=False)
        prompts = held_out_prompts(eng, args.num_prompts)
        outs[kv], blocks[kv] = run(eng, prompts, args.max_tokens), eng.num_blocks
        forced[kv] = forced_stats(teacher_forced(eng, prompts, outs["auto"]))
        dtype = str(eng.dtype).replace("torch.", "")
        eng.close()
    res = compare(outs["auto"], outs["fp8"])
    row = dict(reference_kv=dtype, **res, forced_positions_pct=forced["fp8"]["positions_pct"],
               forced_prompts_pct=forced["fp8"]["prompts_pct"], ref_forced_positions_pct=forced["auto"]["positions_pct"],
               ref_forced_prompts_pct=forced["auto"]["prompts_pct"], blocks_ref=blocks["auto"], blocks_fp8=blocks["fp8"])
    print_table([row], list(row))
    payload = dict(device=device_name(args.device), model=args.model or "SmolLM2-135M (bundled)",
                   max_tokens=args.max_tokens, **row)
    ref = "" if dtype == "float32" else "_bf16" if dtype == "bfloat16" else f"_{dtype}"
    write_json(f"check_kv_fp8_{slug(payload['device'])}_{args.num_prompts}x{args.max_tokens}{ref}", payload)
    return payload


if __name__ == "__main__":
    main()
