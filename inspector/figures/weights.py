"""Model weight bytes: per decoder layer and for the rest (embeddings, final norm, lm_head), stacked by dtype.

Input: the engine's `weight_summary` (engine/quant/linear.py weight_bytes: by_dtype, per_layer, other, total),
so a quantized model shows its int8 / uint8 (int4 codes) / float8 bytes beside the float ones.
"""
from __future__ import annotations

from inspector.figures.layout import _axis, _fig, _layout, empty_spec

DTYPE_COLORS = {"bfloat16": "#4E79A7", "float16": "#76B7B2", "float32": "#59A14F", "float8_e4m3fn": "#F28E2B",
                "int8": "#E15759", "uint8": "#B07AA1"}
DTYPE_LABELS = {"uint8": "uint8 (int4 codes)", "float8_e4m3fn": "float8 e4m3"}


def weights_spec(summary: dict | None, quantization: str | None = None) -> dict:
    title = "Model weights by layer and dtype"
    if not summary or not summary.get("per_layer"):
        return empty_spec(title, "no engine yet")
    cols = [str(i) for i in range(len(summary["per_layer"]))] + ["other"]
    parts = summary["per_layer"] + [summary.get("other", {})]
    data = []
    for dt in sorted(summary["by_dtype"], key=lambda d: -summary["by_dtype"][d]):
        data.append(dict(type="bar", name=DTYPE_LABELS.get(dt, dt), x=cols, y=[p.get(dt, 0) / 2**20 for p in parts],
                         marker=dict(color=DTYPE_COLORS.get(dt, "#BAB0AC")),
                         hovertemplate=f"{dt}<br>layer %{{x}}: %{{y:.2f}} MiB<extra></extra>"))
    totals = " · ".join(f"{DTYPE_LABELS.get(k, k)} {v / 2**30:.2f} GiB"
                        for k, v in sorted(summary["by_dtype"].items(), key=lambda kv: -kv[1]))
    sub = f"{summary['total'] / 2**30:.2f} GiB in all ({totals}); quantization: {quantization or 'none'}"
    lay = _layout(title, 280, "weights", subtitle=sub, barmode="stack",
                  xaxis=_axis(title="decoder layer ('other': embeddings, final norm, lm_head)", type="category"),
                  yaxis=_axis(title="MiB"))
    return {"data": data, "layout": lay}


weights_figure = _fig(weights_spec)
