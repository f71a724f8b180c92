"""KV cache on vs off: without the cache every step recomputes the whole prefix, so decode cost grows with the
sequence and the gap widens with the output length."""
from __future__ import annotations

from inspector.lessons.common import Setup, close, greedy, kv_pool, random_prompts, result, run

TITLE = "KV cache on vs off"
WHAT = ("Without a KV cache each new token recomputes the whole sequence, so tokens per second fall as outputs "
        "grow while the cached engine stays flat: the speed-up grows with the output length.")


def run_lesson(setup: Setup, lengths: list[int] | None = None, prompt_len: int = 16, batch: int = 1) -> dict:
    lengths = lengths or ([50, 100, 200, 400, 800] if setup.large else [8, 16, 32, 64])
    max_len = prompt_len + max(lengths) + 1
    series = {}
    for on in (True, False):
        eng = setup.engine(enable_kv_cache=on, enable_prefix_caching=False, max_model_len=max_len,
                           max_num_batched_tokens=max(256, max_len * batch), max_num_seqs=max(batch, 2),
                           **kv_pool(batch, max_len))
        rows = []
        for L in lengths:
            r = run(eng, random_prompts(batch, prompt_len, eng.arch_config.vocab_size, setup.seed), greedy(L))
            rows.append(dict(output_len=L, output_tok_s=r.output_tokens / r.wall, wall_s=r.wall))
        series["cache on" if on else "cache off"] = rows
        model = eng
        close(eng)
    speedup = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(series["cache on"], series["cache off"])]
    for row, s in zip(series["cache on"], speedup):
        row["speedup"] = s
    summary = dict(speedup_at_longest=speedup[-1], longest=lengths[-1], speedup_at_shortest=speedup[0])
    return result("kv_cache", TITLE, WHAT, model, series, summary, lengths=lengths, prompt_len=prompt_len, batch=batch)
