"""KV cache tiers: fp8 vs model-dtype KV, the host tier on a multi-turn chat workload, swap vs recompute.

  capacity     pool blocks at the same memory budget, model-dtype KV vs fp8 (kv_cache_dtype="fp8")
  multi-turn   users whose conversations (their prefixes) end at ~4x the device pool after --turns rounds, each
               turn resending the whole conversation; mean TTFT with and without the host tier (kv_offload_gib),
               a round's turns sent at once (queueing behind one another) and one turn at a time
  burst        an oversubscribed burst of long prompts with long outputs: preemption_mode recompute vs swap
               vs auto (the cost model's choice); mean TTFT, output tok/s, swaps / preemptions

    python benchmarks/bench_kv_tiers.py [--model PATH] [--device cuda] [--num-kv-blocks N] [--offload-gib 4]
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLMEngine, SamplingParams  # noqa: E402
from engine.runtime.llm_engine import resolve_device  # noqa: E402


def drive(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All prompts at once; mean TTFT (from submission), output tok/s, preemptions and swaps."""
    t0 = time.perf_counter()
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    wall = time.perf_counter() - t0
    ttft = [done[i].metrics.first_token_time - done[i].metrics.arrival_time for i in ids]
    return dict(ttft_mean_s=sum(ttft) / len(ttft), out_tok_s=sum(len(done[i].token_ids) for i in ids) / wall,
                wall_s=wall, preemptions=eng.scheduler.num_preemptions, swaps=eng.scheduler.num_swaps)


def multi_turn(eng: LLMEngine, users: int, turns: int, turn_len: int, answer: int, seed: int,
               together: bool = True) -> dict:
    """Each round every user sends its next turn (the whole conversation so far + new text); mean TTFT.
    together: a round's turns arrive at once (they queue behind one another); else one at a time, round robin,
    so that a turn's TTFT is its own prefill (or copy back) alone."""
    rng = random.Random(seed)
    vocab = eng.arch_config.vocab_size
    convs = [[rng.randrange(vocab) for _ in range(turn_len)] for _ in range(users)]
    sp = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True)
    ttft, t0 = [], time.perf_counter()
    for _ in range(turns):
        for group in ([range(users)] if together else [[u] for u in range(users)]):
            ids = {eng.add_request(convs[u], sp): u for u in group}
            outs = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        outs[o.request_id] = o
            for rid, u in ids.items():
                o = outs[rid]
                ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
                convs[u] = convs[u] + o.token_ids + [rng.randrange(vocab) for _ in range(turn_len)]
    st = eng.stats()
    return dict(ttft_mean_s=sum(ttft) / len(ttft), wall_s=time.perf_counter() - t0,
                prefix_hit_pct=100.0 * st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"]),
                blocks_offloaded=st["offloaded"], blocks_fetched=st["fetched"])


def multi_turn_shape(num_kv_blocks: int, turns: int, scale: float = 1.0) -> tuple[int, int, int, int]:
    """(users, turn_len, answer, max_model_len) of the multi-turn workload: conversations that all together end at
    ~4x a pool of num_kv_blocks 16-token blocks, each fitting max_model_len."""
    users, answer = max(2, int(8 * scale)), 32
    max_len = min(num_kv_blocks * 16 - 16, 4096)     # one sequence fits the pool
    turn_len = max(16, min(num_kv_blocks * 16 * 4 // users, max_len - 1) // turns - answer)
    return users, turn_len, answer, max_len


def median_run(runs: list[dict], key: str) -> dict:
    """The run whose `key` is the median, with every run's `key` beside it (as `<key>_runs`)."""
    r = sorted(runs, key=lambda x: x[key])[len(runs) // 2]
    return dict(r, **{f"{key}_runs": [x[key] for x in runs]})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-kv-blocks", type=int, default=None, help="device pool for the workloads (default: 256 "
                    "on cuda, 64 on cpu) so that they oversubscribe it")
    ap.add_argument("--offload-gib", type=float, default=2.0)
    ap.add_argument("--scale", type=float, default=1.0, help="workload size factor (0.1 for a CPU smoke run)")
    ap.add_argument("--tag", default="", help="suffix of the JSON's name (benchmarks/results/bench_kv_tiers_<device>_"
                    "<model><tag>.json)")
    ap.add_argument("--turns", type=int, default=8, help="multi-turn: rounds of conversation per user")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per configuration (multi-turn and burst), in rotating order; the median is reported")
    ap.add_argument("--workloads", default="capacity,multi-turn,burst", help="which to run, comma-separated")
    args = ap.parse_args(argv)
    workloads = set(args.workloads.split(","))
    unknown = workloads - {"capacity", "multi-turn", "burst"}
    if unknown:
        ap.error(f"--workloads: unknown {sorted(unknown)} (capacity, multi-turn, burst)")
    base = dict(model=args.model, device=args.device, block_size=16)
    rows, res = [], {}

    # capacity at the same budget
    if "capacity" in workloads:
        for kv in ("auto", "fp8"):
            eng = LLMEngine(**base, kv_cache_dtype=kv, max_model_len=2048)
            res[f"capacity_{kv}"] = dict(blocks=eng.num_blocks, bytes_per_token=eng.slot_bytes,
                                         kv_format=str(eng.runner.kv_dtype).replace("torch.", ""))
            eng.close()
        rows.append(dict(workload="capacity", config=f"{res['capacity_auto']['kv_format']} KV",
                         blocks=res["capacity_auto"]["blocks"]))
        rows.append(dict(workload="capacity", config="fp8 KV", blocks=res["capacity_fp8"]["blocks"]))
    cuda = resolve_device(args.device).type == "cuda"
    nb = args.num_kv_blocks or (256 if cuda else 64)

    # multi-turn: each user's conversation grows by a turn and an answer per round; all of them together end
    # at ~4x the device pool
    users, turn_len, answer, max_len = multi_turn_shape(nb, args.turns, args.scale)
    if "multi-turn" in workloads:
        configs = [("no host tier", {}), ("host tier", dict(kv_offload_gib=args.offload_gib))]
        for arrival, together in (("a round at once", True), ("one turn at a time", False)):
            runs: dict[str, list[dict]] = {name: [] for name, _ in configs}
            for rep in range(args.repeats):          # alternating order: neither configuration always goes first
                for name, extra in (configs if rep % 2 == 0 else configs[::-1]):
                    eng = LLMEngine(**base, num_kv_blocks=nb, max_model_len=max_len, **extra)
                    runs[name].append(multi_turn(eng, users, args.turns, turn_len, answer, seed=0,
                                                 together=together))
                    eng.close()
            key = "multi_turn" if together else "multi_turn_serial"
            for name, _ in configs:
                r = median_run(runs[name], "ttft_mean_s")
                res[f"{key}_{name}"] = r
                rows.append(dict(workload=f"multi-turn, {arrival}", config=name, **r))

    # burst: oversubscribed, swap vs recompute vs the cost model; the same prompts for each, the modes in
    # rotating order, the run of median throughput reported
    if "burst" in workloads:
        n = max(4, int(32 * args.scale))
        prompt_len = max(32, nb * 16 // n * 2)
        modes = ("recompute", "swap", "auto")
        bursts: dict[str, list[dict]] = {m: [] for m in modes}
        prompts = None
        for rep in range(args.repeats):
            for mode in modes[rep % 3:] + modes[:rep % 3]:
                # every prompt admitted at once (a small pool would otherwise derive a max_num_seqs that never
                # preempts)
                eng = LLMEngine(**base, num_kv_blocks=nb, kv_offload_gib=args.offload_gib, preemption_mode=mode,
                                max_model_len=max_len, max_num_seqs=n)
                if prompts is None:
                    rng = random.Random(1)
                    vocab = eng.arch_config.vocab_size
                    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(n)]
                bursts[mode].append(drive(eng, prompts, max_tokens=max(16, prompt_len // 2)))
                eng.close()
        for mode in modes:
            r = median_run(bursts[mode], "out_tok_s")
            res[f"burst_{mode}"] = r
            rows.append(dict(workload="burst", config=f"preemption {mode}", **r))
    cols = ["workload", "config", "blocks", "ttft_mean_s", "out_tok_s", "wall_s", "preemptions", "swaps",
            "prefix_hit_pct", "blocks_offloaded", "blocks_fetched"]
    print_table(rows, cols)
    payload = dict(device=device_name(args.device), model=args.model or "SmolLM2-135M (bundled)",
                   num_kv_blocks=nb, turns=args.turns, users=users, turn_len=turn_len, answer=answer,
                   repeats=args.repeats, offload_gib=args.offload_gib, scale=args.scale, rows=rows, results=res)
    model = (args.model or "smollm2-135m").removeprefix("dummy:")
    write_json(f"bench_kv_tiers_{slug(device_name(args.device))}_{slug(Path(model).name)}{args.tag}", payload)
    return payload


if __name__ == "__main__":
    main()
