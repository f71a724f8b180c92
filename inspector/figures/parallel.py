"""The parallel view: how one decoder layer's weights and KV heads are split across the tensor-parallel ranks,
and what each rank holds in memory (its weights and its KV pool).

Input: `LLMEngine.parallel_info()` (rank, device, the [start, count) of query heads, KV heads, MLP rows and
vocabulary rows each rank holds, weight and KV-pool bytes per rank).
"""
from __future__ import annotations

from inspector.figures.layout import _fig, _layout, empty_spec


def _span(s: list[int]) -> str:
    start, n = s
    return f"{start}–{start + n - 1} ({n})" if n else "–"


def parallel_spec(info: dict | None) -> dict:
    title = "Tensor parallelism: one layer's split and each rank's memory"
    if not info or not info.get("ranks"):
        return empty_spec(title, "no engine yet")
    ranks = info["ranks"]
    cols = ["rank", "device", "query heads", "KV heads", "MLP rows", "vocab rows", "weights MiB", "KV pool MiB"]
    cells = [[r["rank"] for r in ranks], [r["device"] for r in ranks],
             [_span(r["q_heads"]) for r in ranks], [_span(r["kv_heads"]) for r in ranks],
             [_span(r["intermediate"]) for r in ranks], [_span(r["vocab"]) for r in ranks],
             [f"{r['weight_bytes'] / 2**20:,.1f}" if r.get("weight_bytes") is not None else "?" for r in ranks],
             [f"{r['kv_pool_bytes'] / 2**20:,.1f}" for r in ranks]]
    sub = (f"{info['layout']} · {info['num_heads']} query heads, {info['num_kv_heads']} KV heads, MLP "
           f"{info['intermediate_size']}, vocabulary {info['vocab_size']} · {info['num_blocks']} KV blocks on "
           "every rank · o_proj and down_proj end in an all-reduce")
    data = [dict(type="table", header=dict(values=cols, align="left", fill=dict(color="#EEF1F6")),
                 cells=dict(values=cells, align="left"))]
    return {"data": data, "layout": _layout(title, 120 + 28 * len(ranks), "parallel", subtitle=sub)}


parallel_figure = _fig(parallel_spec)
