"""Per-step timings (stacked measured regions per engine step) and one profiled step per kernel / op."""
from __future__ import annotations

import numpy as np

from inspector.figures.layout import _axis, _axname, _fig, _grid, _layout, empty_spec
from inspector.figures.style import REGION_COLORS
from inspector.recorder import Snapshot

REGION_ORDER = ["schedule", "draft", "prepare", "embedding", "attention", "mlp", "norms", "lm_head",
                "forward (other)", "grammar mask", "sampling", "postprocess", "unaccounted"]
# which measured regions nest inside which (the engine times both the parent and its parts)
SUBREGIONS = {"forward": ("embedding", "attention", "mlp", "norms", "lm_head"), "schedule": ("draft",)}


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
    title = "Per-step timings"
    steps = [s for s in snap.steps[-max_steps:] if s.timings]
    if not steps:
        msg = "no step timings yet" if not snap.steps else "steps carry no timings (enable_step_timings is off)"
        return empty_spec(title, msg, height, "timings")
    rows = [step_regions(s.timings, s.end - s.start) for s in steps]
    keys = [k for k in REGION_ORDER if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r} - set(keys))
    mean_step = float(np.mean([(s.end - s.start) * 1e3 for s in steps]))
    lay = _layout(title, height, "timings", f"last {len(steps)} steps · mean step {mean_step:.2f} ms · "
                  "regions from StepEvent.timings (CUDA events on GPU, perf_counter on CPU) · click a legend "
                  "entry to hide a region", margin=dict(l=60, r=140, t=80, b=40),
                  legend=dict(orientation="v", x=1.01, xanchor="left", y=1.0, yanchor="top", font=dict(size=10),
                              traceorder="reversed"))
    refs = _grid(lay, rows=[1.0], cols=[0.7, 0.3], hspace=0.14,
                 titles=["ms per step (stacked regions)", "mean ms per step"])
    (xa, ya), (xb, yb) = refs[(1, 1)], refs[(1, 2)]
    x = [s.step for s in steps]
    data, means = [], []
    for k in keys:
        y = [r.get(k, 0.0) * 1e3 for r in rows]
        means.append((k, float(np.mean(y))))
        color = REGION_COLORS.get(k, "#888")
        data.append(dict(type="scatter", x=x, y=y, name=k, mode="lines", stackgroup="regions",
                         line=dict(width=0.5, color=color), fillcolor=color, legendgroup=k, xaxis=xa, yaxis=ya,
                         hovertemplate=f"{k}: %{{y:.2f}} ms<extra>step %{{x}}</extra>"))
    data.append(dict(type="bar", orientation="h", y=[m[0] for m in means], x=[m[1] for m in means],
                     showlegend=False, marker=dict(color=[REGION_COLORS.get(m[0], "#888") for m in means]),
                     hovertemplate="%{y}: %{x:.3f} ms<extra></extra>", xaxis=xb, yaxis=yb))
    graphed = [s.step for s in steps if s.cuda_graph]
    if graphed:
        data.append(dict(type="scatter", x=graphed, y=[0] * len(graphed), mode="markers", name="CUDA graph step",
                         marker=dict(symbol="line-ns", size=6, color="#333", line=dict(width=1)), xaxis=xa, yaxis=ya))
    lay[_axname(yb, "y")].update(autorange="reversed", tickfont=dict(size=10))
    lay[_axname(xa, "x")].update(title=dict(text="engine step"))
    lay[_axname(ya, "y")].update(title=dict(text="ms"))
    lay[_axname(xb, "x")].update(title=dict(text="ms"))
    return {"data": data, "layout": lay}


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
