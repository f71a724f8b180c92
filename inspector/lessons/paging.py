"""Paged vs contiguous KV memory: with the same KV pool, how many requests each layout admits and how much
KV memory a batch holds (the contiguous baseline reserves max_model_len slots per request at admission)."""
from __future__ import annotations

from inspector.lessons.common import Setup, close, greedy, random_prompts, result, run

TITLE = "Paged vs contiguous KV memory"
WHAT = ("With one fixed KV pool, the contiguous layout reserves max_model_len slots per request and runs out at a "
        "small batch, while paged blocks hold only the tokens requests have, so many more fit.")


def run_lesson(setup: Setup, batches: list[int] | None = None, prompt_len: int | None = None,
               output_len: int | None = None, max_model_len: int | None = None, block_size: int = 16) -> dict:
    large = setup.large
    batches = batches or ([1, 2, 4, 8, 16, 32, 64, 128, 256] if large else [1, 2, 4, 8, 16, 32])
    prompt_len = prompt_len or (256 if large else 32)
    output_len = output_len or (128 if large else 8)
    max_model_len = max_model_len or (2048 if large else 256)
    per_contig = -(-max_model_len // block_size)
    num_blocks = per_contig * (24 if large else 6) + 1     # the pool: 24 (6) max-length reservations
    series = {}
    for layout in ("paged", "contiguous"):
        eng = setup.engine(kv_cache_layout=layout, num_kv_blocks=num_blocks, block_size=block_size,
                           max_model_len=max_model_len, max_num_seqs=max(batches),
                           max_num_batched_tokens=max(max_model_len, min(prompt_len * max(batches), 16384)))
        rows = []
        for b in batches:
            prompts = random_prompts(b, prompt_len, eng.arch_config.vocab_size, setup.seed + b)
            r = run(eng, prompts, greedy(output_len))
            rows.append(dict(batch=b, max_running=r.max_running, kv_reserved=r.peak("kv_reserved"),
                             kv_used=r.peak("kv_used"), max_allocated=r.peak("max_allocated"),
                             output_tok_s=r.output_tokens / r.wall))
        series[layout] = rows
        pool_bytes = eng.num_blocks * eng.block_size * eng.slot_bytes
        model = eng
        close(eng)
    admitted = {k: max(r["max_running"] for r in v) for k, v in series.items()}
    both = [(p, c) for p, c in zip(series["paged"], series["contiguous"]) if c["max_running"] == c["batch"]]
    p, c = both[-1]
    summary = dict(max_batch_paged=admitted["paged"], max_batch_contiguous=admitted["contiguous"],
                   admitted_ratio=admitted["paged"] / max(1, admitted["contiguous"]),
                   memory_ratio_at_batch=c["batch"], memory_ratio=c["kv_reserved"] / max(1, p["kv_reserved"]),
                   kv_pool_bytes=pool_bytes)
    return result("paging", TITLE, WHAT, model, series, summary, batches=batches, prompt_len=prompt_len,
                  output_len=output_len, max_model_len=max_model_len, block_size=block_size, num_kv_blocks=num_blocks)
