"""Memory over time: allocated / peak (CUDA allocator on a GPU, the engine's tensors on a CPU), the KV pool, the
KV slots requests hold (reserved) and those holding a token (used), from the step events' `memory`."""
from __future__ import annotations

from inspector.figures.layout import _axis, _axname, _fig, _grid, _layout, empty_spec, thin
from inspector.recorder import Snapshot, steps_by_replica

_MIB = float(1 << 20)
LINES = (("allocated", "allocated", "#222", "solid"), ("max_allocated", "peak allocated", "#888", "dot"),
         ("kv_pool", "KV pool", "#BAB0AC", "dash"), ("kv_reserved", "KV reserved by requests", "#E15759", "solid"),
         ("kv_used", "KV holding tokens", "#4E79A7", "solid"))


def memory_spec(snap: Snapshot, height: int = 300) -> dict:
    """Memory over time; data-parallel replicas: a panel per replica (each samples its own steps)."""
    title = "Memory over time"
    steps = [s for s in snap.steps if getattr(s, "memory", None)]
    if not steps:
        return empty_spec(title, "no step with memory samples yet", height, "memory")
    n = snap.num_replicas
    per = [thin(p) for p in steps_by_replica(steps, n)]
    lasts = [p[-1].memory for p in per if p]
    res, used = sum(m["reserved_slots"] for m in lasts), sum(m["used_slots"] for m in lasts)
    frag = f"{100.0 * (res - used) / res:.0f}%" if res else "—"
    sub = ("The gap between the red and blue lines is KV memory reserved but empty (internal fragmentation): "
           f"now {res} slots reserved, {used} used ({frag} empty)" + (" over all replicas" if n > 1 else ""))
    if n == 1:
        lay = _layout(title, height, "memory", sub, xaxis=_axis(title=dict(text="seconds since first event")),
                      yaxis=_axis(title=dict(text="MiB"), rangemode="tozero"))
        return {"data": _lines(per[0], snap.t0), "layout": lay}
    lay = _layout(title, height + 150 * (n - 1), "memory", sub)
    refs = _grid(lay, rows=[1.0] * n, cols=[1.0], vspace=0.1, share_x=True, titles=[f"replica {r}" for r in range(n)])
    data = []
    for r in range(n):
        xa, ya = refs[(r + 1, 1)]
        data += _lines(per[r], snap.t0, dict(xaxis=xa, yaxis=ya), f"replica {r} · ", first=r == 0)
        lay[_axname(ya, "y")].update(title=dict(text="MiB"), rangemode="tozero")
    lay[_axname(refs[(n, 1)][0], "x")].update(title=dict(text="seconds since first event"))
    return {"data": data, "layout": lay}


def _lines(steps: list, t0: float, axes: dict | None = None, who: str = "", first: bool = True) -> list[dict]:
    """One engine's memory lines; who: before every hover (the replica), first: these carry the legend entries."""
    xs = [s.end - t0 for s in steps]
    data = [dict(type="scatter", x=xs, y=[s.memory[k] / _MIB for s in steps], name=name, mode="lines",
                 line=dict(color=color, width=1.8, dash=dash, shape="hv"),
                 hovertemplate=f"{who}{name} %{{y:.1f}} MiB<extra></extra>", **(axes or {}))
            for k, name, color, dash in LINES]
    data[4].update(fill="tozeroy", fillcolor="rgba(78,121,167,0.12)")
    if who:
        for d in data:
            d.update(legendgroup=d["name"], showlegend=first)
    return data


memory_figure = _fig(memory_spec)
