"""The Lessons' charts: one spec per lesson result (`inspector.lessons`), two panels each, titled with the
sentence that says what it shows and subtitled with the measured ratios."""
from __future__ import annotations

from inspector.figures.layout import _axname, _fig, _grid, _layout, empty_spec

C = {"paged": "#4E79A7", "contiguous": "#E15759", "cache on": "#4E79A7", "cache off": "#E15759",
     "continuous": "#4E79A7", "static": "#E15759", "chunked": "#4E79A7", "unchunked": "#E15759"}
_MIB = float(1 << 20)


def _line(x, y, name, xa, ya, dash="solid", mode="lines+markers", color=None, **kw) -> dict:
    return dict(type="scatter", x=list(x), y=list(y), name=name, mode=mode, xaxis=xa, yaxis=ya,
                line=dict(color=color or C.get(name, "#222"), width=2, dash=dash), marker=dict(size=6), **kw)


def _frame(res: dict, sub: str, titles: list[str], height: int) -> tuple[dict, dict]:
    lay = _layout(f"{res['title']} — {res['model']} on {res['device']}", height, f"lesson-{res['lesson']}",
                  f"{res['what']}<br>{sub}", margin=dict(l=60, r=30, t=120, b=50))
    lay["title"]["font"] = dict(size=13)
    refs = _grid(lay, rows=[1.0], cols=[1, 1], hspace=0.12, titles=titles)
    return lay, refs


def _bar(x, y, name, ref, color) -> dict:
    return dict(type="bar", x=list(x), y=list(y), name=name, xaxis=ref[0], yaxis=ref[1], marker=dict(color=color),
                showlegend=False)


def _axes(lay, ref, x, y, log_x=False):
    lay[_axname(ref[0], "x")].update(title=dict(text=x), **({"type": "log"} if log_x else {}))
    lay[_axname(ref[1], "y")].update(title=dict(text=y), rangemode="tozero")


def _spec(lay, refs, data, left: tuple[str, str], right: tuple[str, str], log_x=False) -> dict:
    """Both panels' axis titles, (x, y) each, and the figure spec."""
    _axes(lay, refs[(1, 1)], *left, log_x=log_x)
    _axes(lay, refs[(1, 2)], *right, log_x=log_x)
    return {"data": data, "layout": lay}


def paging_spec(res: dict, height: int = 400) -> dict:
    s = res["summary"]
    lay, refs = _frame(res, f"same KV pool ({s['kv_pool_bytes'] / _MIB:.1f} MiB): max batch paged "
                       f"{s['max_batch_paged']} vs contiguous {s['max_batch_contiguous']} "
                       f"({s['admitted_ratio']:.1f}×) · at batch {s['memory_ratio_at_batch']} contiguous reserves "
                       f"{s['memory_ratio']:.1f}× the KV memory", ["requests running at once", "peak KV memory"], height)
    data = []
    for layout, rows in res["series"].items():
        b = [r["batch"] for r in rows]
        data.append(_line(b, [r["max_running"] for r in rows], layout, *refs[(1, 1)]))
        data.append(_line(b, [r["kv_reserved"] / _MIB for r in rows], layout, *refs[(1, 2)], showlegend=False))
        data.append(_line(b, [r["kv_used"] / _MIB for r in rows], f"{layout}: holding tokens", *refs[(1, 2)],
                          dash="dot", color=C[layout]))
    b = [r["batch"] for r in res["series"]["paged"]]
    data.append(_line(b, b, "requested", *refs[(1, 1)], dash="dash", mode="lines", color="#BBB"))
    return _spec(lay, refs, data, ("requests submitted together", "max running"),
                 ("requests submitted together", "KV MiB reserved (solid) / used (dotted)"), log_x=True)


def kv_cache_spec(res: dict, height: int = 400) -> dict:
    s = res["summary"]
    lay, refs = _frame(res, f"speed-up {s['speedup_at_shortest']:.1f}× at {res['params']['lengths'][0]} tokens, "
                       f"{s['speedup_at_longest']:.1f}× at {s['longest']}", ["output tok/s", "speed-up (on / off)"],
                       height)
    data = []
    for arm, rows in res["series"].items():
        data.append(_line([r["output_len"] for r in rows], [r["output_tok_s"] for r in rows], arm, *refs[(1, 1)]))
    on = res["series"]["cache on"]
    data.append(_line([r["output_len"] for r in on], [r["speedup"] for r in on], "speed-up", *refs[(1, 2)],
                      color="#59A14F"))
    return _spec(lay, refs, data, ("output tokens", "tok/s"), ("output tokens", "×"))


def batching_spec(res: dict, height: int = 400) -> dict:
    s = res["summary"]
    lay, refs = _frame(res, f"continuous {s['continuous_tok_s']:.0f} vs static {s['static_tok_s']:.0f} output tok/s "
                       f"({s['throughput_ratio']:.2f}×) · mean TTFT {s['mean_ttft_ratio']:.2f}× lower",
                       ["TTFT per request (submission order)", "output tok/s"], height)
    data = []
    for mode, d in res["series"].items():
        data.append(_line(range(len(d["ttft_s"])), [t * 1e3 for t in d["ttft_s"]], mode, *refs[(1, 1)],
                          mode="markers"))
    modes = list(res["series"])
    data.append(_bar(modes, [res["series"][m]["output_tok_s"] for m in modes], "tok/s", refs[(1, 2)],
                     [C[m] for m in modes]))
    return _spec(lay, refs, data, ("request", "TTFT ms"), ("", "tok/s"))


def batch_sweep_spec(res: dict, height: int = 400) -> dict:
    s = res["summary"]
    rows = res["series"]["sweep"]
    b = [r["batch"] for r in rows]
    roof = "roofline" in " ".join(rows[0])
    lay, refs = _frame(res, f"batch {b[0]} → {b[-1]}: {s['tok_s_ratio']:.1f}× the decode tok/s for "
                       f"{s['step_time_ratio']:.1f}× the time per step"
                       + (f" · HBM {s['hbm_bytes_per_s'] / 1e12:.2f} TB/s measured (dashed: roofline)" if roof else ""),
                       ["decode tok/s", "ms per decode step"], height)
    data = [_line(b, [r["decode_tok_s"] for r in rows], "measured", *refs[(1, 1)], color="#4E79A7"),
            _line(b, [r["ms_per_step"] for r in rows], "ms/step", *refs[(1, 2)], color="#4E79A7", showlegend=False)]
    if roof:
        data += [_line(b, [r["roofline_tok_s"] for r in rows], "HBM roofline", *refs[(1, 1)], dash="dash",
                       mode="lines", color="#E15759"),
                 _line(b, [r["roofline_ms_per_step"] for r in rows], "HBM floor", *refs[(1, 2)], dash="dash",
                       mode="lines", color="#E15759", showlegend=False)]
    return _spec(lay, refs, data, ("batch", "tok/s"), ("batch", "ms"), log_x=True)


def chunked_prefill_spec(res: dict, height: int = 400) -> dict:
    s = res["summary"]
    lay, refs = _frame(res, f"worst inter-token gap of the decoding requests: {s['unchunked_max_itl_ms']:.0f} ms "
                       f"unchunked vs {s['chunked_max_itl_ms']:.0f} ms chunked ({s['max_itl_ratio']:.1f}×)",
                       ["ITL of the decoding requests over time", "ITL mean / p99 / max"], height)
    data = []
    for arm, d in res["series"].items():
        data.append(_line([t for t in d["t_s"]], d["itl_ms"], arm, *refs[(1, 1)], mode="markers"))
        data.append(_bar(["mean", "p99", "max"], [d["mean_itl_ms"], d["p99_itl_ms"], d["max_itl_ms"]], arm,
                         refs[(1, 2)], C[arm]))
    lay["barmode"] = "group"
    return _spec(lay, refs, data, ("seconds since the first token", "ITL ms"), ("", "ms"))


def kv_tiers_spec(res: dict, height: int = 400) -> dict:
    s, ser = res["summary"], res["series"]
    arms = list(ser)
    cap = " · ".join(f"{a.split(' · ')[0]} {ser[a]['blocks']} blocks" for a in arms[::2])
    lay, refs = _frame(res, f"same KV memory: {cap} ({s['capacity_ratio']:.1f}×) · best: {s['best_throughput']} "
                       f"({s['throughput_ratio']:.2f}× tok/s, mean TTFT {s['ttft_ratio']:.2f}× lower)",
                       ["mean TTFT", "output tok/s"], height)
    colors = ["#E15759", "#F28E2B", "#4E79A7", "#59A14F"]
    hover = [f"{ser[a]['blocks']} blocks · {ser[a]['preemptions']} preemptions · {ser[a]['swaps']} swaps" for a in arms]
    data = [dict(_bar(arms, [ser[a]["mean_ttft_s"] * 1e3 for a in arms], "TTFT", refs[(1, 1)], colors),
                 hovertext=hover),
            dict(_bar(arms, [ser[a]["output_tok_s"] for a in arms], "tok/s", refs[(1, 2)], colors), hovertext=hover)]
    return _spec(lay, refs, data, ("KV format · preemption", "ms"), ("KV format · preemption", "tok/s"))


BUILDERS = {"paging": paging_spec, "kv_cache": kv_cache_spec, "batching": batching_spec,
            "batch_sweep": batch_sweep_spec, "chunked_prefill": chunked_prefill_spec, "kv_tiers": kv_tiers_spec}


def lesson_spec(res: dict | None, height: int = 400) -> dict:
    """The chart of one lesson result (an empty chart before it has run)."""
    if not res:
        return empty_spec("Lesson", "press a lesson's button to run it", height, "lesson")
    return BUILDERS[res["lesson"]](res, height)


lesson_figure = _fig(lesson_spec)
