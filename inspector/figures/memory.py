"""Memory over time: allocated / peak (CUDA allocator on a GPU, the engine's tensors on a CPU), the KV pool, the
KV slots requests hold (reserved) and those holding a token (used), from the step events' `memory`."""
from __future__ import annotations

import math

from inspector.figures.layout import _axis, _fig, _layout, empty_spec
from inspector.recorder import Snapshot

_MIB = float(1 << 20)
LINES = (("allocated", "allocated", "#222", "solid"), ("max_allocated", "peak allocated", "#888", "dot"),
         ("kv_pool", "KV pool", "#BAB0AC", "dash"), ("kv_reserved", "KV reserved by requests", "#E15759", "solid"),
         ("kv_used", "KV holding tokens", "#4E79A7", "solid"))


def memory_spec(snap: Snapshot, height: int = 300) -> dict:
    title = "Memory over time"
    steps = [s for s in snap.steps if getattr(s, "memory", None)]
    if not steps:
        return empty_spec(title, "no step with memory samples yet", height, "memory")
    steps = steps[-2000:]
    steps = steps[::max(1, math.ceil(len(steps) / 600))]           # at most ~600 points per line
    xs = [s.end - snap.t0 for s in steps]
    last = steps[-1].memory
    res, used = last["reserved_slots"], last["used_slots"]
    frag = f"{100.0 * (res - used) / res:.0f}%" if res else "—"
    data = [dict(type="scatter", x=xs, y=[s.memory[k] / _MIB for s in steps], name=name, mode="lines",
                 line=dict(color=color, width=1.8, dash=dash, shape="hv"),
                 hovertemplate=f"{name} %{{y:.1f}} MiB<extra></extra>") for k, name, color, dash in LINES]
    data[4].update(fill="tozeroy", fillcolor="rgba(78,121,167,0.12)")
    lay = _layout(title, height, "memory",
                  "The gap between the red and blue lines is KV memory reserved but empty (internal fragmentation): "
                  f"now {res} slots reserved, {used} used ({frag} empty)",
                  xaxis=_axis(title=dict(text="seconds since first event")),
                  yaxis=_axis(title=dict(text="MiB"), rangemode="tozero"))
    return {"data": data, "layout": lay}


memory_figure = _fig(memory_spec)
