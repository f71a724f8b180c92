"""Scheduler timeline: per-request Gantt of front end / waiting / prefill / decode / preempted spans, and the per-step
batch composition below it."""
from __future__ import annotations

from inspector.figures.layout import LEGEND_ROOM, _axname, _fig, _grid, _layout, empty_spec
from inspector.figures.style import PHASE_COLORS, PHASE_LABELS
from inspector.recorder import Snapshot, steps_by_replica
from inspector.tracks import PHASES


def timeline_spec(snap: Snapshot, axis: str = "time", max_requests: int = 40, max_steps: int = 400,
                  height: int | None = None) -> dict:
    """Gantt of the latest requests (waiting / prefill / decode / preempted spans) over time or engine
    steps, and below it the per-step batch composition (prefill vs decode tokens, running / waiting).
    Data-parallel replicas: the requests grouped by replica, and a batch panel per replica (its own steps)."""
    by_step = axis == "step"
    reqs = [r for r in snap.requests if r.spans][-max_requests:]
    title = "Scheduler timeline"
    if not reqs and not snap.steps:
        return empty_spec(title, "no requests yet — send a prompt or start a load", height or 420, "timeline")
    n = snap.num_replicas
    if n > 1:
        reqs.sort(key=lambda r: r.engine_index)     # stable: by arrival within each replica
    t0 = snap.t0
    n_all = sum(1 for r in snap.requests if r.spans)
    steps = snap.steps[-max_steps:]
    h = height or int(min(940, max(470, 250 + 16 * len(reqs))) + 110 * (n - 1))
    lay = _layout(title, h, f"timeline-{axis}",
                  f"latest {len(reqs)} of {n_all} requests · last {len(steps)} steps · "
                  "front end / waiting / prefill (chunks) / decode / preempted"
                  + (f" · {n} data-parallel replicas, each with its own steps" if n > 1 else ""),
                  margin=dict(l=90, r=50, t=70, b=40 + LEGEND_ROOM), barmode="stack", bargap=0.15)
    rows = [0.72, 0.28] if n == 1 else [0.72] + [0.28] * n
    refs = _grid(lay, rows=rows, cols=[1.0], vspace=0.05, share_x=True,
                 secondary=tuple((k, 1) for k in range(2, n + 2)),
                 titles=None if n == 1 else [""] + [f"replica {r}: batch and queue" for r in range(n)])
    x1, y1 = refs[(1, 1)]
    data: list[dict] = []
    for phase in PHASES:
        ys, xs, bases, hov = [], [], [], []
        for r in reqs:
            for sp in r.spans:
                if sp.phase != phase:
                    continue
                a, b = (sp.step_start, sp.step_end) if by_step else (sp.start - t0, sp.end - t0)
                if b - a <= 0 and phase in ("frontend", "waiting", "preempted", "swapped"):
                    continue
                ys.append(r.request_id)
                bases.append(a)
                xs.append(max(b - a, 0.05 if by_step else 1e-4))
                extra = f" · {sp.num_tokens} tok" if sp.num_tokens else ""
                note = f" ({sp.note})" if sp.note else ""
                hov.append(f"{r.request_id} · {phase}{note}{extra}{_prio(r)}{_replica(r, n)}<br>{sp.start - t0:.3f}–"
                           f"{sp.end - t0:.3f} s ({(sp.end - sp.start) * 1e3:.1f} ms) · steps {sp.step_start:.0f}–"
                           f"{sp.step_end:.0f}")
        data.append(dict(type="bar", orientation="h", y=ys, x=xs, base=bases, name=PHASE_LABELS.get(phase, phase), hovertext=hov,
                         hoverinfo="text", marker=dict(color=PHASE_COLORS[phase], line=dict(width=0)),
                         xaxis=x1, yaxis=y1, legendgroup=phase, width=0.8))
    ends = [r for r in reqs if r.finished is not None]
    if ends:
        data.append(dict(type="scatter", mode="markers", showlegend=False, xaxis=x1, yaxis=y1,
                         y=[r.request_id for r in ends],
                         x=[(max((s.step_end for s in r.spans), default=0.0) if by_step else r.finished - t0) for r in ends],
                         marker=dict(symbol=["x-thin" if r.status != "finished" else "line-ns" for r in ends], size=9,
                                     color="#333", line=dict(width=2, color="#333")),
                         hovertext=[f"{r.request_id}: {r.status} ({r.finish_reason or ''}) · {r.output_len} tokens"
                                    + (f" · {r.num_preemptions} preemptions" if r.num_preemptions else "") + _prio(r)
                                    + _replica(r, n) for r in ends],
                         hoverinfo="text"))
    per = steps_by_replica(steps, n)
    for r in range(n):
        x2, y2 = refs[(r + 2, 1)]
        y2b = refs[(r + 2, 1, "y2")]
        mine = per[r]
        data += _batch_traces(mine, t0, by_step, x2, y2, y2b, "" if n == 1 else f"replica {r} · ", first=r == 0)
        lay[_axname(y2, "y")].update(title=dict(text="tokens/step"))
        lay[_axname(y2b, "y")].update(title=dict(text="seqs"), rangemode="tozero", tickformat="d")
    lay[_axname(y1, "y")].update(type="category", categoryorder="array",
                                 categoryarray=[r.request_id for r in reversed(reqs)], tickfont=dict(size=9))
    if n > 1:
        _replica_groups(lay, reqs, y1)
    lay[_axname(x2, "x")].update(title=dict(text="engine step" if by_step else "seconds since first event"))
    return {"data": data, "layout": lay}


def _batch_traces(steps: list, t0: float, by_step: bool, x2: str, y2: str, y2b: str, who: str,
                  first: bool) -> list[dict]:
    """One engine's steps: prefill and decode tokens per step (bars), running and waiting (lines), preemptions.
    who: before every hover text (the replica); first: these lines carry the legend entries."""
    if not steps:
        return []
    if by_step:
        x = [s.step + 0.5 for s in steps]
        w = [1.0] * len(steps)
    else:
        x = [(s.start + s.end) / 2 - t0 for s in steps]
        w = [max(1e-4, s.end - s.start) for s in steps]
    hov = [f"{who}step {s.step}: {len(s.scheduled)} seqs, {s.num_prefill_tokens}+{s.num_decode_tokens} tok, "
           f"{(s.end - s.start) * 1e3:.1f} ms{' (graph)' if s.cuda_graph else ''}"
           + _block_text(s)
           + (f"<br>preempted {', '.join(s.preempted[:4])}" if s.preempted else "") for s in steps]
    data = [dict(type="bar", x=x, y=[s.num_prefill_tokens for s in steps], width=w, name="prefill tokens",
                 marker=dict(color=PHASE_COLORS["prefill"], line=dict(width=0)), hovertext=hov,
                 hoverinfo="text", showlegend=False, xaxis=x2, yaxis=y2),
            dict(type="bar", x=x, y=[s.num_decode_tokens for s in steps], width=w, name="decode tokens",
                 marker=dict(color=PHASE_COLORS["decode"], line=dict(width=0)), hovertext=hov,
                 hoverinfo="text", showlegend=False, xaxis=x2, yaxis=y2),
            dict(type="scatter", x=x, y=[s.num_running for s in steps], mode="lines", name="running",
                 line=dict(color="#222", width=1.5, shape="hv"), xaxis=x2, yaxis=y2b),
            dict(type="scatter", x=x, y=[s.num_waiting for s in steps], mode="lines", name="waiting (queue)",
                 line=dict(color="#888", width=1.5, dash="dot", shape="hv"), xaxis=x2, yaxis=y2b)]
    if who:     # the replicas' lines toggle together, under the first one's legend entries
        for d, group in zip(data[2:], ("running", "waiting")):
            d.update(legendgroup=group, showlegend=first, hovertemplate=f"{who}{d['name']} %{{y}}<extra></extra>")
    pre = [(xx, s) for xx, s in zip(x, steps) if s.preempted]
    if pre:
        data.append(dict(type="scatter", mode="markers", name="preemption", xaxis=x2, yaxis=y2,
                         x=[p[0] for p in pre], y=[p[1].num_prefill_tokens + p[1].num_decode_tokens for p in pre],
                         marker=dict(symbol="triangle-down", color=PHASE_COLORS["preempted"], size=10),
                         hovertext=[f"{who}step {p[1].step}: preempted {', '.join(p[1].preempted)}" for p in pre],
                         hoverinfo="text"))
        if who:
            data[-1].update(legendgroup="preemption", showlegend=first)
    return data


def _replica_groups(lay: dict, reqs: list, y1: str) -> None:
    """Data parallelism: a rule between the Gantt's replica groups and each group's name at its top right
    (reqs: sorted by replica; the category axis lists them bottom up)."""
    pos = {r.request_id: i for i, r in enumerate(reversed(reqs))}
    groups: dict[int, list[int]] = {}
    for r in reqs:
        groups.setdefault(r.engine_index, []).append(pos[r.request_id])
    shapes, notes = lay.setdefault("shapes", []), lay.setdefault("annotations", [])
    for k, (e, idx) in enumerate(sorted(groups.items())):
        top = max(idx)
        if k:
            shapes.append(dict(type="line", xref="paper", x0=0, x1=1, yref=y1, y0=top + 0.5, y1=top + 0.5,
                               line=dict(color="#888", width=1, dash="dot")))
        notes.append(dict(text=f"replica {e}", xref="paper", x=1.0, xanchor="right", yref=y1, y=top + 0.45,
                          yanchor="top", showarrow=False, font=dict(size=10, color="#555"),
                          bgcolor="rgba(255,255,255,0.75)"))


timeline_figure = _fig(timeline_spec)


def _prio(r) -> str:
    """The request's SamplingParams.priority (lower = admitted sooner under the priority policy) and its output
    constraint, for a hover."""
    p = getattr(r, "priority", None)
    s = getattr(r, "structured", None)
    return ("" if p is None else f" · priority {p}") + (f" · constrained ({s})" if s else "")


def _replica(r, n: int) -> str:
    """The request's data-parallel replica, for a hover (nothing with one engine)."""
    return f" · replica {r.engine_index}" if n > 1 else ""


def _block_text(s) -> str:
    """A decode block's iterations and, under multi_step_max_ms, why that many (StepEvent.block_plan)."""
    k, plan = getattr(s, "num_decode_steps", 1), getattr(s, "block_plan", None)
    if k <= 1 and not plan:
        return ""
    text = f", {k} decode iteration{'s' if k > 1 else ''}"
    if plan:
        text += f"<br>{plan['iteration_ms']:.1f} ms an iteration: the budget allows {plan['budget_iterations']}"
        if plan["cover_iterations"] is not None and plan["host_round_ms"] is not None:
            text += (f", hiding the host's {plan['host_round_ms']:.1f} ms between blocks takes "
                     f"{plan['cover_iterations']}")
        elif plan["host_round_ms"] is not None:
            text += " (newcomers wait: the budget alone)"
    return text
