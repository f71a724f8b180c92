"""Per-step timings (stacked measured regions per engine step) and one profiled step per kernel / op."""
from __future__ import annotations

import numpy as np

from inspector.figures.layout import _axis, _axname, _fig, _grid, _layout, empty_spec
from inspector.figures.style import REGION_COLORS
from inspector.recorder import Snapshot, steps_by_replica

REGION_ORDER = ["schedule", "draft", "prepare", "embedding", "layers", "attention", "mlp", "norms", "lm_head", "all_reduce",
                "all_gather", "forward (other)", "grammar mask", "sampling", "postprocess", "unaccounted"]
MODEL_REGIONS = ("embedding", "layers", "attention", "mlp", "norms", "lm_head", "all_reduce", "all_gather")
# which measured regions nest inside which (the engine times both the parent and its parts)
SUBREGIONS = {"forward": MODEL_REGIONS, "schedule": ("draft",)}


def step_regions(timings: dict[str, float], wall: float) -> dict[str, float]:
    """Split a step's measured regions into non-overlapping leaves that sum to the step's wall time:
    forward -> its parts + "forward (other)", schedule -> draft + schedule, rest -> "unaccounted"."""
    out: dict[str, float] = {}
    nested = {c for cs in SUBREGIONS.values() for c in cs}
    top = 0.0
    for k, v in timings.items():
        if k in nested:
            continue
        v = float(v)
        if k in SUBREGIONS:
            parts = 0.0
            for c in SUBREGIONS[k]:
                if c in timings:
                    out[c] = out.get(c, 0.0) + float(timings[c])
                    parts += float(timings[c])
            label = "forward (other)" if k == "forward" else k
            out[label] = out.get(label, 0.0) + max(0.0, v - parts)
            top += max(v, parts)
        else:
            out[k] = out.get(k, 0.0) + v
            top += v
    for c in nested:       # a sub-region measured without its parent
        if c in timings and c not in out:
            out[c] = float(timings[c])
            top += float(timings[c])
    out["unaccounted"] = max(0.0, wall - top)
    return out


def timings_spec(snap: Snapshot, max_steps: int = 300, height: int = 360) -> dict:
    """Each step's measured regions, stacked, and their means; data-parallel replicas: a row per replica (each
    counts its own steps)."""
    title = "Per-step timings"
    steps = [s for s in snap.steps[-max_steps:] if s.timings]
    if not steps:
        msg = "no step timings yet" if not snap.steps else "steps carry no timings (enable_step_timings is off)"
        return empty_spec(title, msg, height, "timings")
    n = snap.num_replicas
    per = steps_by_replica(steps, n)
    rows = [[step_regions(s.timings, s.end - s.start) for s in p] for p in per]
    keys = [k for k in REGION_ORDER if any(k in r for rr in rows for r in rr)]
    keys += sorted({k for rr in rows for r in rr for k in r} - set(keys))
    mean_step = float(np.mean([(s.end - s.start) * 1e3 for s in steps]))
    lay = _layout(title, height, "timings", f"last {len(steps)} steps · mean step {mean_step:.2f} ms · "
                  "regions from StepEvent.timings (CUDA events on GPU, perf_counter on CPU) · click a legend "
                  "entry to hide a region", margin=dict(l=60, r=140, t=80, b=40),
                  legend=dict(orientation="v", x=1.01, xanchor="left", y=1.0, yanchor="top", font=dict(size=10),
                              traceorder="reversed"))
    ranked = n == 1 and any(s.rank_timings for s in steps)
    if n > 1:
        titles = [t for r in range(n) for t in (f"replica {r}: ms per step (stacked regions)", "mean ms per step")]
        lay["height"] = height = int(height * (1 + 0.6 * (n - 1)))
    else:
        titles = ["ms per step (stacked regions, rank 0)", "mean ms per step"]
    if ranked:
        titles += ["each rank: model regions and all-reduce, ms per step", "mean per rank"]
        lay["height"] = height = int(height * 1.6)
    refs = _grid(lay, rows=[0.6, 0.4] if ranked else [1.0] * n, cols=[0.7, 0.3], hspace=0.14,
                 vspace=0.16 if n == 1 else 0.22, titles=titles)
    data = []
    for r in range(n):
        (xa, ya), (xb, yb) = refs[(r + 1, 1)], refs[(r + 1, 2)]
        data += _region_traces(per[r], rows[r], keys, (xa, ya), (xb, yb), first=r == 0)
        lay[_axname(yb, "y")].update(autorange="reversed", tickfont=dict(size=10))
        lay[_axname(xa, "x")].update(title=dict(text="engine step"))
        lay[_axname(ya, "y")].update(title=dict(text="ms"))
        lay[_axname(xb, "x")].update(title=dict(text="ms"))
    if ranked:
        data += _rank_traces(steps, refs[(2, 1)], refs[(2, 2)])
        lay[_axname(refs[(2, 2)][1], "y")].update(autorange="reversed", tickfont=dict(size=10))
        lay[_axname(refs[(2, 1)][1], "y")].update(title=dict(text="ms"))
    return {"data": data, "layout": lay}


def _region_traces(steps, rows: list[dict], keys: list[str], line_ax, bar_ax, first: bool = True) -> list[dict]:
    """One engine's steps: the stacked regions per step, their means, the CUDA graph and eagerly timed steps.
    first: these carry the legend entries (the regions of every replica toggle together)."""
    if not steps:
        return []
    (xa, ya), (xb, yb) = line_ax, bar_ax
    x = [s.step for s in steps]
    data, means = [], []
    for k in keys:
        y = [r.get(k, 0.0) * 1e3 for r in rows]
        means.append((k, float(np.mean(y))))
        color = REGION_COLORS.get(k, "#888")
        data.append(dict(type="scatter", x=x, y=y, name=k, mode="lines", stackgroup="regions",
                         line=dict(width=0.5, color=color), fillcolor=color, legendgroup=k, xaxis=xa, yaxis=ya,
                         hovertemplate=f"{k}: %{{y:.2f}} ms<extra>step %{{x}}</extra>"))
        if not first:
            data[-1]["showlegend"] = False
    data.append(dict(type="bar", orientation="h", y=[m[0] for m in means], x=[m[1] for m in means],
                     showlegend=False, marker=dict(color=[REGION_COLORS.get(m[0], "#888") for m in means]),
                     hovertemplate="%{y}: %{x:.3f} ms<extra></extra>", xaxis=xb, yaxis=yb))
    graphed = [s.step for s in steps if s.cuda_graph]
    if graphed:
        data.append(dict(type="scatter", x=graphed, y=[0] * len(graphed), mode="markers", name="CUDA graph step",
                         marker=dict(symbol="line-ns", size=6, color="#333", line=dict(width=1)), xaxis=xa, yaxis=ya))
    sampled = [s.step for s in steps if getattr(s, "timings_sampled", False)]
    if sampled:   # graph-eligible steps run eagerly to time their regions (EngineConfig.graph_timing_interval)
        data.append(dict(type="scatter", x=sampled, y=[0] * len(sampled), mode="markers",
                         name="timed eagerly (sampled graph step)", xaxis=xa, yaxis=ya,
                         marker=dict(symbol="triangle-up", size=8, color="#E15759")))
    if not first:
        for d in data[len(keys) + 1:]:
            d.update(legendgroup=d["name"], showlegend=False)
    return data


def _rank_traces(steps, line_ax, bar_ax) -> list[dict]:
    """Tensor parallelism: per rank, the model's regions (what its device computed) and the all-reduce part of
    them, per step; rank 0's come from StepEvent.timings, the others' from StepEvent.rank_timings."""
    ranks = sorted({0} | {int(r) for s in steps for r in (s.rank_timings or {})})
    x = [s.step for s in steps]
    data, bars = [], []
    for r in ranks:
        per = [(s.timings if r == 0 else (s.rank_timings or {}).get(r, {})) or {} for s in steps]
        model = [sum(float(t.get(k, 0.0)) for k in MODEL_REGIONS) * 1e3 for t in per]
        comm = [(float(t.get("all_reduce", 0.0)) + float(t.get("all_gather", 0.0))) * 1e3 for t in per]
        for name, y, dash in ((f"rank {r} model", model, "solid"), (f"rank {r} all-reduce + gather", comm, "dot")):
            data.append(dict(type="scatter", x=x, y=y, name=name, mode="lines", line=dict(width=1.2, dash=dash),
                             xaxis=line_ax[0], yaxis=line_ax[1],
                             hovertemplate=f"{name}: %{{y:.2f}} ms<extra>step %{{x}}</extra>"))
            bars.append((name, float(np.mean(y))))
    data.append(dict(type="bar", orientation="h", y=[b[0] for b in bars], x=[b[1] for b in bars], showlegend=False,
                     marker=dict(color=["#4E79A7" if "model" in b[0] else "#F28E2B" for b in bars]),
                     hovertemplate="%{y}: %{x:.3f} ms<extra></extra>", xaxis=bar_ax[0], yaxis=bar_ax[1]))
    return data


def profile_spec(rows: list[dict] | None, height: int = 440, top: int = 20) -> dict:
    """One profiled step (torch.profiler key averages) as a horizontal bar per kernel / op."""
    title = "One profiled step, per kernel / op"
    if not rows:
        return empty_spec(title, "press “Profile one step” while requests are running", height, "profile")
    key = "device_time_ms" if any((r.get("device_time_ms") or 0) > 0 for r in rows) else "cpu_time_ms"
    rows = sorted(rows, key=lambda r: -(r.get(key) or 0))[:top]
    names = [str(r.get("name", "?"))[:70] for r in rows]
    data = [dict(type="bar", orientation="h", y=names, x=[float(r.get(key) or 0) for r in rows],
                 marker=dict(color=["#E15759" if ("triton" in n.lower() or "_kernel" in n.lower()) else "#4E79A7"
                                    for n in names]),
                 customdata=[r.get("count", "") for r in rows],
                 hovertemplate="%{y}<br>%{x:.3f} ms · %{customdata} calls<extra></extra>")]
    lay = _layout(title, height, "profile", f"top {len(rows)} by self {key.replace('_time_ms', '')} time · "
                  "red = Triton kernels", margin=dict(l=300, r=20, t=64, b=40),
                  yaxis=_axis(autorange="reversed", tickfont=dict(size=10)),
                  xaxis=_axis(title=dict(text=f"self {key.replace('_time_ms', '')} time (ms)")))
    return {"data": data, "layout": lay}


timings_figure = _fig(timings_spec)
profile_figure = _fig(profile_spec)
