"""Plotly figure builders for the inspector. Pure functions of a `Snapshot` (and a kv snapshot dict).

Rules kept everywhere (see NOTES "Gradio and Plotly"): an explicit height, a `uirevision` so zoom and
legend toggles survive live refreshes, numeric axes (the Gantt is `go.Bar` with `base`, never
`px.timeline`), fixed colour ranges for heatmaps, histograms binned here rather than in the browser,
and bounded payloads (latest N requests / steps).
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Callable

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from inspector import metrics as M
from inspector.recorder import Snapshot, step_output_tokens

PHASE_COLORS = {"waiting": "#C7CDD6", "prefill": "#F28E2B", "decode": "#4E79A7", "preempted": "#E15759"}
# block map categories: 0 free, 1 cached-free (evictable), 2 shared (ref > 1), 3.. owner palette
OWNER_PALETTE = ["#4E79A7", "#59A14F", "#B07AA1", "#EDC948", "#76B7B2", "#FF9DA7", "#9C755F", "#F28E2B",
                 "#86BCB6", "#D37295", "#499894", "#8CD17D"]
FREE_COLOR, CACHED_COLOR, SHARED_COLOR, NULL_COLOR = "#EEF0F3", "#B8E0D2", "#3D2C8D", "#FFFFFF"
N_CATS = 3 + len(OWNER_PALETTE)
REGION_ORDER = ["schedule", "draft", "prepare", "embedding", "attention", "mlp", "norms", "lm_head",
                "forward (other)", "sampling", "postprocess", "unaccounted"]
REGION_COLORS = {"schedule": "#BAB0AC", "draft": "#D4A6C8", "prepare": "#9D7660", "embedding": "#FABFD2",
                 "attention": "#E15759", "mlp": "#4E79A7", "norms": "#76B7B2", "lm_head": "#59A14F",
                 "forward (other)": "#EDC948", "sampling": "#B07AA1", "postprocess": "#FF9DA7",
                 "unaccounted": "#D7D7D7"}
# which measured regions nest inside which (the engine times both the parent and its parts)
SUBREGIONS = {"forward": ("embedding", "attention", "mlp", "norms", "lm_head"), "schedule": ("draft",)}
FONT = dict(family="Inter, system-ui, sans-serif", size=12)


def _layout(fig: go.Figure, title: str, height: int, revision: str, **kw) -> go.Figure:
    kw.setdefault("margin", dict(l=60, r=20, t=44, b=40))
    fig.update_layout(title=dict(text=title, x=0.01, xanchor="left", font=dict(size=14)), height=height,
                      uirevision=revision, font=FONT,
                      plot_bgcolor="white", paper_bgcolor="white",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0), **kw)
    fig.update_xaxes(gridcolor="#ECECEC", zerolinecolor="#DDDDDD")
    fig.update_yaxes(gridcolor="#ECECEC", zerolinecolor="#DDDDDD")
    return fig


def empty_figure(title: str, message: str, height: int = 260, revision: str = "empty") -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                       font=dict(size=14, color="#666"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _layout(fig, title, height, revision)


def error_figure(title: str, err: BaseException | str, height: int = 260) -> go.Figure:
    msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return empty_figure(title, f"could not draw this chart<br><sup>{msg[:200]}</sup>", height, "error")


def _owner_color_index(rid: str) -> int:
    return zlib.crc32(rid.encode()) % len(OWNER_PALETTE)


def owner_color(rid: str) -> str:
    return OWNER_PALETTE[_owner_color_index(rid)]


# ----------------------------------------------------------------------------- 1. KV block map
def _grid_shape(n: int, max_cols: int = 64) -> tuple[int, int]:
    cols = min(max_cols, max(8, 2 ** math.ceil(math.log2(max(1, math.sqrt(n * 2))))))
    return math.ceil(n / cols), cols


def block_states(kv: dict) -> dict:
    """Per-block state arrays and owners from a kv snapshot."""
    n = int(kv["num_blocks"])
    ref = np.asarray(kv.get("ref_counts") or [0] * n, dtype=np.int64)
    cached = np.asarray(kv.get("cached") or [False] * n, dtype=bool)
    owners: list[list[str]] = [[] for _ in range(n)]
    for rid, table in (kv.get("block_tables") or {}).items():
        for b in table:
            if 0 <= b < n:
                owners[b].append(rid)
    cat = np.zeros(n, dtype=np.int64)                   # free
    cat[(ref == 0) & cached] = 1                        # cached-free
    in_use = ref > 0
    cat[in_use & (ref > 1)] = 2                         # shared
    for b in np.nonzero(in_use & (ref == 1))[0]:
        cat[b] = 3 + (_owner_color_index(owners[b][0]) if owners[b] else 0)
    return dict(n=n, ref=ref, cached=cached, owners=owners, cat=cat,
                num_free=int(((ref == 0) & ~cached).sum()) - 1, num_cached_free=int(((ref == 0) & cached).sum()),
                num_in_use=int(in_use.sum()), num_shared=int((ref > 1).sum()))


def _discrete_colorscale(colors: list[str]) -> list:
    k = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / k, c], [(i + 1) / k, c]]
    return scale


_CATEGORY_COLORS = [FREE_COLOR, CACHED_COLOR, SHARED_COLOR] + OWNER_PALETTE


def block_map_figure(kv: dict | None, highlight: str | None = None, height: int | None = None,
                     max_cells: int = 4096) -> go.Figure:
    """Every physical block of the KV pool as a cell: free / cached-free / shared / owner request.
    Pools larger than `max_cells` are shown as groups of consecutive blocks (majority state)."""
    title = "KV block map"
    if not kv or not kv.get("num_blocks"):
        return empty_figure(title, "no KV snapshot yet", height or 300, "blockmap")
    st = block_states(kv)
    n = st["n"]
    group = max(1, math.ceil(n / max_cells))
    cells = math.ceil(n / group)
    rows, cols = _grid_shape(cells)
    z = np.full(rows * cols, np.nan)
    text = [""] * (rows * cols)
    cat, ref, cached, owners = st["cat"], st["ref"], st["cached"], st["owners"]
    if group == 1:
        z[:n] = cat
        z[0] = np.nan if ref[0] == 0 else z[0]          # block 0 is the null block
        for b in range(n):
            if b == 0 and ref[0] == 0:
                text[b] = "block 0 · null block (reserved)"
            elif ref[b] == 0:
                text[b] = f"block {b} · {'cached-free (evictable, prefix hash kept)' if cached[b] else 'free'}"
            else:
                own = ", ".join(owners[b][:6]) + (" …" if len(owners[b]) > 6 else "")
                state = "shared" if ref[b] > 1 else "in use"
                text[b] = (f"block {b} · {state} · ref {ref[b]}{' · cached' if cached[b] else ''}"
                           f"<br>owners: {own or '?'}")
    else:
        for c in range(cells):
            lo, hi = c * group, min(n, (c + 1) * group)
            seg = cat[lo:hi]
            used = int((ref[lo:hi] > 0).sum())
            cf = int(((ref[lo:hi] == 0) & cached[lo:hi]).sum())
            z[c] = 2 if (ref[lo:hi] > 1).any() else (3 if used > (hi - lo) / 2 else (1 if cf > (hi - lo) / 2 else 0))
            if used and z[c] == 3:
                vals, counts = np.unique(seg[seg >= 3], return_counts=True)
                z[c] = vals[np.argmax(counts)] if len(vals) else 3
            text[c] = f"blocks {lo}–{hi - 1} · {used} in use · {cf} cached-free · {hi - lo - used - cf} free"
    zg = z.reshape(rows, cols)
    tg = [text[r * cols:(r + 1) * cols] for r in range(rows)]
    fig = go.Figure(go.Heatmap(
        z=zg, text=tg, hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=N_CATS - 0.5,
        colorscale=_discrete_colorscale(_CATEGORY_COLORS), showscale=False, xgap=1, ygap=1))
    # legend swatches
    for name, color in (("free", FREE_COLOR), ("cached-free", CACHED_COLOR), ("shared (ref>1)", SHARED_COLOR),
                        ("in use (colour = request)", OWNER_PALETTE[0])):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                                 marker=dict(symbol="square", size=12, color=color,
                                             line=dict(width=1, color="#999"))))
    if highlight and group == 1:
        blocks = (kv.get("block_tables") or {}).get(highlight) or []
        if blocks:
            fig.add_trace(go.Scatter(
                x=[b % cols for b in blocks], y=[b // cols for b in blocks], mode="markers+text",
                text=[str(i) for i in range(len(blocks))], textfont=dict(size=9, color="white"),
                marker=dict(symbol="square-open", size=14, color="black", line=dict(width=2)),
                name=f"{highlight} (logical index)", hovertemplate="logical %{text}<extra>" + highlight + "</extra>"))
    used_pct = 100.0 * st["num_in_use"] / max(1, n - 1)
    sub = (f"{n} blocks × {kv.get('block_size', '?')} tokens · {st['num_in_use']} in use ({used_pct:.0f}%) · "
           f"{st['num_shared']} shared · {st['num_cached_free']} cached-free · {max(0, st['num_free'])} free"
           + (f" · 1 cell = {group} blocks" if group > 1 else ""))
    h = height or int(min(560, max(220, 90 + rows * (18 if cols <= 32 else 12))))
    fig.update_xaxes(visible=False, range=[-0.5, cols - 0.5])
    fig.update_yaxes(visible=False, autorange="reversed", scaleanchor=None)
    return _layout(fig, f"{title}<br><sup>{sub}</sup>", h, "blockmap", margin=dict(l=10, r=10, t=64, b=10))


def block_table_figure(kv: dict | None, request_id: str | None, height: int = 220) -> go.Figure:
    """A request's block table: logical block i -> physical block id (colour: private / shared / cached)."""
    title = "Block table"
    if not request_id:
        return empty_figure(title, "select a request to see its block table", height, "blocktable")
    tables = (kv or {}).get("block_tables") or {}
    table = tables.get(request_id)
    if not table:
        return empty_figure(f"{title}: {request_id}", "this request holds no KV blocks right now "
                            "(waiting, preempted or finished)", height, "blocktable")
    ref = (kv or {}).get("ref_counts") or []
    cached = (kv or {}).get("cached") or []
    bs = kv.get("block_size", 16)
    cols = min(32, len(table))
    rows = math.ceil(len(table) / cols)
    z = np.full(rows * cols, np.nan)
    text = [""] * (rows * cols)
    hover = [""] * (rows * cols)
    for i, b in enumerate(table):
        r = ref[b] if b < len(ref) else 1
        c = bool(cached[b]) if b < len(cached) else False
        z[i] = 2 if r > 1 else (1 if c else 0)
        text[i] = str(b)
        hover[i] = (f"logical {i} (tokens {i * bs}–{(i + 1) * bs - 1}) → physical {b}<br>ref {r}"
                    f"{' · shared' if r > 1 else ''}{' · cached (full, hashed)' if c else ''}")
    fig = go.Figure(go.Heatmap(
        z=z.reshape(rows, cols), text=[text[i * cols:(i + 1) * cols] for i in range(rows)],
        customdata=[hover[i * cols:(i + 1) * cols] for i in range(rows)], texttemplate="%{text}",
        hovertemplate="%{customdata}<extra></extra>", zmin=-0.5, zmax=2.5, showscale=False, xgap=2, ygap=2,
        colorscale=_discrete_colorscale([owner_color(request_id), CACHED_COLOR, SHARED_COLOR])))
    fig.update_xaxes(title_text="logical block (mod 32)", dtick=1 if cols <= 16 else 4)
    fig.update_yaxes(visible=False, autorange="reversed")
    return _layout(fig, f"{title}: {request_id} — {len(table)} blocks (cell text = physical block id)",
                   max(height, 120 + 30 * rows), "blocktable")


# ----------------------------------------------------------------------------- 2. scheduler timeline
def timeline_figure(snap: Snapshot, axis: str = "time", max_requests: int = 40, max_steps: int = 600,
                    height: int | None = None) -> go.Figure:
    """Gantt of the latest requests (waiting / prefill / decode / preempted spans) over time or engine
    steps, and below it the per-step batch composition (prefill vs decode tokens, running / waiting)."""
    by_step = axis == "step"
    reqs = [r for r in snap.requests if r.spans][-max_requests:]
    title = "Scheduler timeline"
    if not reqs and not snap.steps:
        return empty_figure(title, "no requests yet — send a prompt or start a load", height or 420, "timeline")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.04,
                        specs=[[{}], [{"secondary_y": True}]])
    t0 = snap.t0
    labels = {r.request_id: r.request_id for r in reqs}
    for phase in ("waiting", "prefill", "decode", "preempted"):
        ys, xs, bases, hov = [], [], [], []
        for r in reqs:
            for sp in r.spans:
                if sp.phase != phase:
                    continue
                a, b = (sp.step_start, sp.step_end) if by_step else ((sp.start - t0), (sp.end - t0))
                if b - a <= 0 and phase in ("waiting", "preempted"):
                    continue
                ys.append(labels[r.request_id])
                bases.append(a)
                xs.append(max(b - a, 1e-4 if not by_step else 0.05))
                extra = f" · {sp.num_tokens} tok" if sp.num_tokens else ""
                note = f" · {sp.note}" if sp.note else ""
                hov.append(f"{r.request_id} · {phase}{note}{extra}<br>"
                           f"{(sp.start - t0):.3f}–{(sp.end - t0):.3f} s ({(sp.end - sp.start) * 1e3:.1f} ms)"
                           f"<br>steps {sp.step_start:.0f}–{sp.step_end:.0f}")
        if ys:
            fig.add_trace(go.Bar(y=ys, x=xs, base=bases, orientation="h", name=phase, hovertext=hov,
                                 hoverinfo="text", marker=dict(color=PHASE_COLORS[phase], line=dict(width=0)),
                                 legendgroup=phase), row=1, col=1)
    # status markers at the end of finished / aborted requests
    ends = [(r.request_id, (r.finished - t0) if not by_step else max((s.step_end for s in r.spans), default=0),
             r.status, r.finish_reason) for r in reqs if r.finished is not None]
    if ends:
        fig.add_trace(go.Scatter(y=[e[0] for e in ends], x=[e[1] for e in ends], mode="markers", name="finished",
                                 marker=dict(symbol=["x" if e[2] == "aborted" else "line-ns" for e in ends],
                                             size=9, color="#333", line=dict(width=2, color="#333")),
                                 hovertext=[f"{e[0]}: {e[2]} ({e[3] or ''})" for e in ends], hoverinfo="text",
                                 showlegend=False), row=1, col=1)
    steps = snap.steps[-max_steps:]
    if steps:
        if by_step:
            x = [s.step + 0.5 for s in steps]
            w = [1.0] * len(steps)
        else:
            x = [((s.start + s.end) / 2 - t0) for s in steps]
            w = [max(1e-4, s.end - s.start) for s in steps]
        hov = [f"step {s.step} · {len(s.scheduled)} seqs · {s.num_prefill_tokens} prefill + {s.num_decode_tokens} "
               f"decode tokens · {(s.end - s.start) * 1e3:.1f} ms{' · CUDA graph' if s.cuda_graph else ''}"
               + (f"<br>preempted: {', '.join(s.preempted[:5])}" if s.preempted else "") for s in steps]
        fig.add_trace(go.Bar(x=x, y=[s.num_prefill_tokens for s in steps], width=w, name="prefill tokens",
                             marker=dict(color=PHASE_COLORS["prefill"], line=dict(width=0)), hovertext=hov,
                             hoverinfo="text", showlegend=False), row=2, col=1)
        fig.add_trace(go.Bar(x=x, y=[s.num_decode_tokens for s in steps], width=w, name="decode tokens",
                             marker=dict(color=PHASE_COLORS["decode"], line=dict(width=0)), hovertext=hov,
                             hoverinfo="text", showlegend=False), row=2, col=1)
        fig.add_trace(go.Scatter(x=x, y=[s.num_running for s in steps], mode="lines", name="running",
                                 line=dict(color="#222", width=1.5, shape="hv")), row=2, col=1, secondary_y=True)
        fig.add_trace(go.Scatter(x=x, y=[s.num_waiting for s in steps], mode="lines", name="waiting",
                                 line=dict(color="#999", width=1.5, dash="dot", shape="hv")),
                      row=2, col=1, secondary_y=True)
        pre = [(xx, s) for xx, s in zip(x, steps) if s.preempted]
        if pre:
            fig.add_trace(go.Scatter(x=[p[0] for p in pre], y=[p[1].num_prefill_tokens + p[1].num_decode_tokens
                                                                for p in pre],
                                     mode="markers", name="preemption", marker=dict(symbol="triangle-down",
                                                                                   color=PHASE_COLORS["preempted"], size=9),
                                     hovertext=[f"step {p[1].step}: preempted {', '.join(p[1].preempted)}" for p in pre],
                                     hoverinfo="text"), row=2, col=1)
    fig.update_layout(barmode="stack", bargap=0.0)
    fig.update_yaxes(title_text=None, type="category", categoryorder="array",
                     categoryarray=[labels[r.request_id] for r in reversed(reqs)], row=1, col=1,
                     tickfont=dict(size=9))
    fig.update_yaxes(title_text="tokens", row=2, col=1)
    fig.update_yaxes(title_text="seqs", row=2, col=1, secondary_y=True, showgrid=False)
    fig.update_xaxes(title_text="engine step" if by_step else "seconds", row=2, col=1)
    n_all = sum(1 for r in snap.requests if r.spans)
    sub = f"latest {len(reqs)} of {n_all} requests" + (f" · last {len(steps)} steps" if steps else "")
    h = height or int(min(900, max(420, 200 + 16 * len(reqs))))
    return _layout(fig, f"{title}<br><sup>{sub}</sup>", h, f"timeline-{axis}", margin=dict(l=90, r=50, t=64, b=40))


# ----------------------------------------------------------------------------- 3. per-step timings
def step_regions(timings: dict[str, float], wall: float) -> dict[str, float]:
    """Split a step's measured regions into non-overlapping leaves that sum to the step's wall time."""
    out: dict[str, float] = {}
    nested = {c for cs in SUBREGIONS.values() for c in cs}
    top = 0.0
    for k, v in timings.items():
        if k in nested:
            continue
        v = float(v)
        if k in SUBREGIONS:
            parts = sum(float(timings.get(c, 0.0)) for c in SUBREGIONS[k])
            for c in SUBREGIONS[k]:
                if c in timings:
                    out[c] = out.get(c, 0.0) + float(timings[c])
            other = v - parts
            label = "forward (other)" if k == "forward" else k
            out[label] = out.get(label, 0.0) + max(0.0, other)
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


def timings_figure(snap: Snapshot, max_steps: int = 400, height: int = 360) -> go.Figure:
    title = "Per-step timings"
    steps = [s for s in snap.steps[-max_steps:] if s.timings]
    if not steps:
        msg = ("no step timings yet" if not snap.steps else
               "steps carry no timings (enable_step_timings is off)")
        return empty_figure(title, msg, height, "timings")
    rows = [step_regions(s.timings, s.end - s.start) for s in steps]
    keys = [k for k in REGION_ORDER if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r} - set(keys))
    fig = make_subplots(rows=1, cols=2, column_widths=[0.74, 0.26], horizontal_spacing=0.09,
                        subplot_titles=("ms per step (stacked regions)", "mean ms per step"))
    x = [s.step for s in steps]
    means = []
    for k in keys:
        y = [r.get(k, 0.0) * 1e3 for r in rows]
        means.append((k, float(np.mean(y))))
        color = REGION_COLORS.get(k, None)
        fig.add_trace(go.Scatter(x=x, y=y, name=k, mode="lines", stackgroup="regions", line=dict(width=0.5, color=color),
                                 fillcolor=color, hovertemplate=f"{k}: %{{y:.2f}} ms<extra>step %{{x}}</extra>",
                                 legendgroup=k), row=1, col=1)
    fig.add_trace(go.Bar(y=[m[0] for m in means], x=[m[1] for m in means], orientation="h", showlegend=False,
                         marker=dict(color=[REGION_COLORS.get(m[0], "#888") for m in means]),
                         hovertemplate="%{y}: %{x:.2f} ms<extra></extra>"), row=1, col=2)
    graphed = [s.step for s in steps if s.cuda_graph]
    if graphed:
        fig.add_trace(go.Scatter(x=graphed, y=[0] * len(graphed), mode="markers", name="CUDA graph step",
                                 marker=dict(symbol="line-ns", size=6, color="#333", line=dict(width=1))), row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=2, tickfont=dict(size=10))
    fig.update_xaxes(title_text="engine step", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=1, col=1)
    tot = float(np.mean([(s.end - s.start) * 1e3 for s in steps]))
    return _layout(fig, f"{title}<br><sup>last {len(steps)} steps · mean step {tot:.2f} ms</sup>", height, "timings",
                   margin=dict(l=60, r=20, t=90, b=40))


def profile_figure(rows: list[dict] | None, height: int = 420, top: int = 20) -> go.Figure:
    """One profiled step (torch.profiler key averages) as a horizontal bar per kernel/op."""
    title = "One profiled step, per kernel"
    if not rows:
        return empty_figure(title, "press “Profile one step” while requests are running", height, "profile")
    key = "device_time_ms" if any((r.get("device_time_ms") or 0) > 0 for r in rows) else "cpu_time_ms"
    rows = sorted(rows, key=lambda r: -(r.get(key) or 0))[:top]
    names = [str(r.get("name", "?"))[:60] for r in rows]
    fig = go.Figure(go.Bar(y=names, x=[r.get(key) or 0 for r in rows], orientation="h",
                           marker=dict(color=["#E15759" if ("triton" in n.lower() or "kernel" in n.lower()) else "#4E79A7"
                                              for n in names]),
                           customdata=[r.get("count", "") for r in rows],
                           hovertemplate="%{y}<br>%{x:.3f} ms · %{customdata} calls<extra></extra>"))
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=10))
    fig.update_xaxes(title_text=f"self {key.replace('_time_ms', '')} time (ms)")
    return _layout(fig, title, height, "profile", margin=dict(l=260, r=20, t=44, b=40))


# ----------------------------------------------------------------------------- 4. speculative decoding
def spec_figure(snap: Snapshot, height: int = 320, window: int = 20) -> go.Figure:
    title = "Speculative decoding"
    sp = snap.spec or {}
    if not sp.get("num_drafts"):
        return empty_figure(title, "speculative decoding is not enabled — set speculative_method "
                            "(ngram / draft / self) in Engine settings", height, "spec")
    drafts = sp["num_drafts"]
    rate = sp["num_accepted_tokens"] / max(1, sp["num_draft_tokens"])
    mean_len = 1 + sp["num_accepted_tokens"] / max(1, drafts)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.38, 0.62], horizontal_spacing=0.1,
                        subplot_titles=("acceptance per draft position", "over time (rolling)"),
                        specs=[[{}, {"secondary_y": True}]])
    per = sp.get("accepted_per_pos") or []
    fig.add_trace(go.Bar(x=[f"pos {i + 1}" for i in range(len(per))], y=[v / drafts for v in per],
                         marker=dict(color="#59A14F"), name="accepted / drafts",
                         hovertemplate="%{x}: %{y:.1%}<extra></extra>", showlegend=False), row=1, col=1)
    hist = sp.get("history") or []
    if hist:
        arr = np.asarray([(h[0], h[2], h[3], h[4]) for h in hist], dtype=np.float64)
        k = min(window, len(arr))
        kern = np.ones(k)
        d = np.convolve(arr[:, 1], kern, "valid")
        dt = np.convolve(arr[:, 2], kern, "valid")
        acc = np.convolve(arr[:, 3], kern, "valid")
        x = arr[k - 1:, 0]
        fig.add_trace(go.Scatter(x=x, y=acc / np.maximum(dt, 1), name="acceptance rate", mode="lines",
                                 line=dict(color="#59A14F")), row=1, col=2)
        fig.add_trace(go.Scatter(x=x, y=1 + acc / np.maximum(d, 1), name="mean acceptance length", mode="lines",
                                 line=dict(color="#4E79A7")), row=1, col=2, secondary_y=True)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", title_text="acceptance rate", row=1, col=2)
    fig.update_yaxes(title_text="tokens / step", row=1, col=2, secondary_y=True, showgrid=False)
    fig.update_xaxes(title_text="engine step", row=1, col=2)
    sub = (f"acceptance rate {rate:.1%} (accepted / drafted) · mean acceptance length {mean_len:.2f} "
           f"(1 + accepted / drafts) · {drafts} drafts, {sp['num_draft_tokens']} draft tokens")
    return _layout(fig, f"{title}<br><sup>{sub}</sup>", height, "spec", margin=dict(l=60, r=60, t=90, b=40))


# ----------------------------------------------------------------------------- 5. latency / throughput
def _hist(values_ms: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v = values_ms[np.isfinite(values_ms)]
    if v.size == 0:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    hi = float(np.percentile(v, 99.5)) if v.size > 20 else float(v.max())
    lo = float(v.min())
    if hi <= lo:
        hi = lo + 1e-3
    counts, edges = np.histogram(np.clip(v, lo, hi), bins=bins, range=(lo, hi))
    return (edges[:-1] + edges[1:]) / 2, counts, np.diff(edges)


def latency_figure(records, height: int = 300, bins: int = 30) -> go.Figure:
    """TTFT / TPOT / ITL / E2EL histograms (binned here; the browser only gets the bars)."""
    title = "Latency distributions"
    done = M.completed(records)
    if not done:
        return empty_figure(title, "no finished requests yet", height, "latency")
    df = M.request_frame(done)
    series = {"TTFT": df["ttft"].to_numpy() * 1e3, "TPOT": df["tpot"].to_numpy() * 1e3,
              "ITL": M.itl_values(done) * 1e3, "E2EL": df["e2el"].to_numpy() * 1e3}
    titles = []
    for name, v in series.items():
        s = M.stats(v, scale=1.0)
        titles.append(f"{name} ms · p50 {s['p50']:.1f} · p99 {s['p99']:.1f}" if s["n"] else f"{name} ms · —")
    fig = make_subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.05)
    colors = {"TTFT": "#F28E2B", "TPOT": "#4E79A7", "ITL": "#76B7B2", "E2EL": "#B07AA1"}
    for i, (name, v) in enumerate(series.items(), start=1):
        c, n, w = _hist(np.asarray(v, dtype=np.float64), bins)
        fig.add_trace(go.Bar(x=c, y=n, width=w, name=name, marker=dict(color=colors[name], line=dict(width=0)),
                             hovertemplate=f"{name} %{{x:.2f}} ms: %{{y}}<extra></extra>", showlegend=False),
                      row=1, col=i)
        fig.update_xaxes(title_text="ms", row=1, col=i)
    fig.update_annotations(font=dict(size=11))
    fig.update_layout(bargap=0.02)
    return _layout(fig, f"{title}<br><sup>{len(done)} finished requests · "
                   "TTFT arrival→first token · TPOT (E2EL−TTFT)/(n−1) · ITL gap between outputs · "
                   "E2EL arrival→last token</sup>", height, "latency", margin=dict(l=50, r=20, t=90, b=40))


def throughput_figure(snap: Snapshot, height: int = 340, max_bins: int = 120) -> go.Figure:
    """Prompt / generation tok/s over time (binned from step events), KV usage and running / waiting."""
    title = "Throughput and KV usage"
    steps = snap.steps
    if not steps:
        return empty_figure(title, "no engine steps yet", height, "throughput")
    t0 = snap.t0
    ends = np.asarray([s.end - t0 for s in steps])
    span = max(ends[-1] - (steps[0].start - t0), 1e-3)
    width = max(0.25, span / max_bins)
    width = float(10 ** math.floor(math.log10(width)) * min((m for m in (1, 2, 5, 10)
                                                              if m * 10 ** math.floor(math.log10(width)) >= width)))
    start = math.floor((steps[0].start - t0) / width) * width
    idx = np.floor((ends - start) / width).astype(int)
    nb = int(idx.max()) + 1
    prompt = np.bincount(idx, weights=[s.num_prefill_tokens for s in steps], minlength=nb)
    gen = np.bincount(idx, weights=[step_output_tokens(s) for s in steps], minlength=nb)
    xb = start + (np.arange(nb) + 0.5) * width
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.55, 0.45], vertical_spacing=0.06,
                        specs=[[{}], [{"secondary_y": True}]])
    fig.add_trace(go.Scatter(x=xb, y=gen / width, name="generation tok/s", mode="lines", line=dict(color="#4E79A7", width=2, shape="hvh")), row=1, col=1)
    fig.add_trace(go.Scatter(x=xb, y=prompt / width, name="prompt tok/s", mode="lines",
                             line=dict(color="#F28E2B", width=1.5, shape="hvh")), row=1, col=1)
    sub = steps[-2000:]
    xs = [s.end - t0 for s in sub]
    fig.add_trace(go.Scatter(x=xs, y=[100 * s.kv_usage for s in sub], name="KV usage %", mode="lines",
                             line=dict(color="#E15759", width=1.5), fill="tozeroy", fillcolor="rgba(225,87,89,0.12)"),
                  row=2, col=1)
    fig.add_trace(go.Scatter(x=xs, y=[s.num_running for s in sub], name="running", mode="lines",
                             line=dict(color="#222", width=1, shape="hv")), row=2, col=1, secondary_y=True)
    fig.add_trace(go.Scatter(x=xs, y=[s.num_waiting for s in sub], name="waiting", mode="lines",
                             line=dict(color="#999", width=1, dash="dot", shape="hv")), row=2, col=1, secondary_y=True)
    fig.update_yaxes(title_text="tok/s", row=1, col=1, rangemode="tozero")
    fig.update_yaxes(title_text="KV %", range=[0, 105], row=2, col=1)
    fig.update_yaxes(title_text="seqs", row=2, col=1, secondary_y=True, showgrid=False, rangemode="tozero")
    fig.update_xaxes(title_text="seconds", row=2, col=1)
    tot = snap.totals
    sub_t = (f"{tot.get('output_tokens', 0)} generated · {tot.get('prompt_tokens', 0)} prompt tokens computed · "
             f"{tot.get('preemptions', 0)} preemptions · prefix-cache hits "
             f"{tot.get('prefix_cache_hits', 0)}/{tot.get('prefix_cache_queries', 0)} tokens · bin {width:g} s")
    return _layout(fig, f"{title}<br><sup>{sub_t}</sup>", height, "throughput", margin=dict(l=60, r=50, t=64, b=40))


# ----------------------------------------------------------------------------- all at once
FIGURES: dict[str, Callable[..., go.Figure]] = {
    "block_map": lambda snap: block_map_figure(snap.kv),
    "timeline": lambda snap: timeline_figure(snap, axis="time"),
    "timeline_step": lambda snap: timeline_figure(snap, axis="step"),
    "timings": timings_figure,
    "spec": spec_figure,
    "latency": lambda snap: latency_figure(snap.records),
    "throughput": throughput_figure,
}
TITLES = {"block_map": "KV block map", "timeline": "Scheduler timeline", "timeline_step": "Scheduler timeline",
          "timings": "Per-step timings", "spec": "Speculative decoding", "latency": "Latency distributions",
          "throughput": "Throughput and KV usage"}


def build_all(snap: Snapshot, names: list[str] | None = None) -> dict[str, go.Figure]:
    """Every inspector figure for one snapshot; a failing builder yields an error figure, never raises."""
    out: dict[str, Any] = {}
    for name in names or list(FIGURES):
        try:
            out[name] = FIGURES[name](snap)
        except Exception as e:  # one broken chart never takes the others down
            import logging
            logging.getLogger(__name__).exception("figure %s failed", name)
            out[name] = error_figure(TITLES.get(name, name), e)
    return out
