"""A Playground chat turn on the CPU: the bundled SmolLM2 answering one chat message, fp32 weights against int4 (the
app's CPU default). TTFT (request added -> first token) and the decode rate after
it, best of --repeats, one engine at a time. Prints a table, writes benchmarks/results/cpu_chat.json.

    python benchmarks/bench_cpu_chat.py [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, print_table, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Explain how a paged KV cache works in an LLM inference engine, in three "
                                        "short paragraphs."}]


def chat_turn(llm: LLM, ids: list[int], tokens: int) -> tuple[float, float]:
    """(TTFT s, decode tok/s after the first token) of one greedy answer."""
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request(ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    first = end = None
    n = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if first is None and o.token_ids:
                first = time.perf_counter()
            if o.finished:
                end, n = time.perf_counter(), len(o.token_ids)
    return first - t0, (n - 1) / (end - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    configs = {"fp32": {}, "int4 (app default)": dict(quantization="int4", int4_group_size=32)}
    load0 = os.getloadavg()
    rows = []
    for name, cfg in configs.items():
        t = time.perf_counter()
        llm = LLM(None, device="cpu", cpu_kv_cache_gib=0.25, **cfg)
        start_s = time.perf_counter() - t
        tok = llm.tokenizer
        ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)
        llm.generate([ids], SamplingParams(max_tokens=4), use_tqdm=False)          # warm-up
        runs = [chat_turn(llm, ids, args.tokens) for _ in range(args.repeats)]
        rows.append(dict(weights=name, prompt_tokens=len(ids), ttft_ms=1e3 * min(r[0] for r in runs),
                         decode_tok_s=max(r[1] for r in runs), start_s=start_s))
        llm.engine.close()
    print_table(rows, ["weights", "prompt_tokens", "ttft_ms", "decode_tok_s", "start_s"])
    load1 = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {list(load0)}, after {list(load1)}")
    write_json("cpu_chat", dict(device=device_name("cpu"), tokens=args.tokens, repeats=args.repeats,
                                load_average=dict(before=load0, after=load1), rows=rows))


if __name__ == "__main__":
    main()
