"""Chunked prefill on vs off: requests are decoding when long prompts arrive. Unchunked, a whole prompt runs
in one step and every running request's next token waits for it; chunked, each step carries a slice of the
prompt beside the decodes, so inter-token latency stays near one small step."""
from __future__ import annotations

import numpy as np

from inspector.lessons.common import Setup, close, greedy, kv_pool, random_prompts, result, run

TITLE = "Chunked prefill on vs off"
WHAT = ("Long prompts arriving while others decode: without chunking a whole prompt runs in one step and the "
        "decoding requests stall (ITL spikes); chunked prefill spreads it over small steps.")


def run_lesson(setup: Setup, num_decoders: int | None = None, long_prompt: int | None = None,
               num_long: int | None = None, chunk: int | None = None, output_len: int | None = None) -> dict:
    large = setup.large
    dec = num_decoders or (32 if large else 4)
    long_prompt = long_prompt or (4096 if large else 1024)
    num_long = num_long or (4 if large else 2)
    chunk = chunk or (512 if large else 64)
    output_len = output_len or (256 if large else 48)
    max_len = long_prompt + output_len + 16
    series = {}
    for chunked in (True, False):
        eng = setup.engine(enable_chunked_prefill=chunked, max_num_batched_tokens=chunk if chunked else max_len,
                           max_model_len=max_len, num_scheduler_steps=1, enable_prefix_caching=False,
                           max_num_seqs=dec + num_long, **kv_pool(dec + num_long, max_len))
        V = eng.arch_config.vocab_size
        longs = random_prompts(num_long, long_prompt, V, setup.seed + 1)
        arrive_at = {output_len // 4 + 3 * i: p for i, p in enumerate(longs)}   # while the decoders run

        def add_long(e, i):
            if i in arrive_at:
                e.add_request(arrive_at[i], greedy(4), request_id=f"long-{i}")
        r = run(eng, random_prompts(dec, 8, V, setup.seed), greedy(output_len), on_step=add_long)
        itl, t_first = [], None
        for o in r.outputs.values():
            if o.request_id.startswith("long"):
                continue
            t = np.asarray(o.metrics.token_times)
            t_first = t[0] if t_first is None else min(t_first, t[0])
            itl.append(np.diff(t))
        times = np.concatenate([np.asarray(o.metrics.token_times[1:]) for o in r.outputs.values()
                                if not o.request_id.startswith("long")]) - t_first
        gaps = np.concatenate(itl) * 1e3
        order = np.argsort(times)
        series["chunked" if chunked else "unchunked"] = dict(
            t_s=times[order].tolist(), itl_ms=gaps[order].tolist(), mean_itl_ms=float(gaps.mean()),
            p99_itl_ms=float(np.percentile(gaps, 99)), max_itl_ms=float(gaps.max()), wall_s=r.wall)
        model = eng
        close(eng)
    c, u = series["chunked"], series["unchunked"]
    summary = dict(max_itl_ratio=u["max_itl_ms"] / c["max_itl_ms"], p99_itl_ratio=u["p99_itl_ms"] / c["p99_itl_ms"],
                   chunked_max_itl_ms=c["max_itl_ms"], unchunked_max_itl_ms=u["max_itl_ms"])
    return result("chunked_prefill", TITLE, WHAT, model, series, summary, num_decoders=dec, long_prompt=long_prompt,
                  num_long=num_long, chunk=chunk, output_len=output_len)
