"""Plotly figure builders for the inspector: pure functions of a `Snapshot` (and a kv snapshot dict).

Each chart has a `*_spec()` that returns a plain Plotly JSON dict (`{"data": [...], "layout": {...}}`)
and a `*_figure()` that wraps it in a `plotly.graph_objects.Figure` for notebooks. The app serialises the
specs directly (`to_json`): building through plotly's validated object tree costs ~50 ms per subplot
figure on a 2-core CPU, the dict path ~1-5 ms, and the engine shares those cores.

Rules kept everywhere (NOTES, "Gradio and Plotly"): an explicit height, a `uirevision` so zoom and legend
toggles survive live refreshes, numeric axes (the Gantt is a horizontal bar with `base`, never
`px.timeline`), fixed colour ranges for heatmaps, histograms binned here rather than in the browser, and
bounded payloads (latest N requests / steps).
"""
from __future__ import annotations

import json
import logging
import math
import zlib
from typing import Callable

import numpy as np

from inspector import metrics as M
from inspector.recorder import Snapshot, step_output_tokens

log = logging.getLogger(__name__)

PHASE_COLORS = {"waiting": "#C7CDD6", "prefill": "#F28E2B", "decode": "#4E79A7", "preempted": "#E15759"}
# block map categories: 0 free, 1 cached-free (evictable), 2 shared (ref > 1), 3.. owner palette
OWNER_PALETTE = ["#4E79A7", "#59A14F", "#B07AA1", "#EDC948", "#76B7B2", "#FF9DA7", "#9C755F", "#F28E2B",
                 "#86BCB6", "#D37295", "#499894", "#8CD17D"]
FREE_COLOR, CACHED_COLOR, SHARED_COLOR = "#EEF0F3", "#B8E0D2", "#3D2C8D"
CATEGORY_COLORS = [FREE_COLOR, CACHED_COLOR, SHARED_COLOR] + OWNER_PALETTE
N_CATS = len(CATEGORY_COLORS)
REGION_ORDER = ["schedule", "draft", "prepare", "embedding", "attention", "mlp", "norms", "lm_head",
                "forward (other)", "sampling", "postprocess", "unaccounted"]
REGION_COLORS = {"schedule": "#BAB0AC", "draft": "#D4A6C8", "prepare": "#9D7660", "embedding": "#FABFD2",
                 "attention": "#E15759", "mlp": "#4E79A7", "norms": "#76B7B2", "lm_head": "#59A14F",
                 "forward (other)": "#EDC948", "sampling": "#B07AA1", "postprocess": "#FF9DA7",
                 "unaccounted": "#D7D7D7"}
# which measured regions nest inside which (the engine times both the parent and its parts)
SUBREGIONS = {"forward": ("embedding", "attention", "mlp", "norms", "lm_head"), "schedule": ("draft",)}
FONT = dict(family="Inter, system-ui, -apple-system, sans-serif", size=12, color="#222")
GRID = "#ECECEC"


# ----------------------------------------------------------------------------- plumbing
def _lst(a) -> list:
    """A JSON-safe list from an array (NaN / inf -> None)."""
    arr = np.asarray(a, dtype=np.float64)
    if np.isfinite(arr).all():
        return arr.tolist()
    return [None if not math.isfinite(x) else x for x in arr.tolist()]


def _sanitize(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _sanitize(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_sanitize(v) for v in o]
    if isinstance(o, np.ndarray):
        return _sanitize(o.tolist())
    if isinstance(o, np.generic):
        return _sanitize(o.item())
    return o


def to_json(spec: dict) -> str:
    """Serialise a spec for the browser (what plotly's Figure.to_json would send, without the template)."""
    try:
        return json.dumps(spec, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError):
        return json.dumps(_sanitize(spec), allow_nan=False, separators=(",", ":"))


def as_figure(spec: dict):
    """Wrap a spec in a plotly Figure (validates every property; for notebooks and tests)."""
    import plotly.graph_objects as go
    return go.Figure(_sanitize(spec))


def _axis(**kw) -> dict:
    d = dict(gridcolor=GRID, zerolinecolor="#DDDDDD", linecolor="#CCCCCC", automargin=True)
    d.update(kw)
    return d


def _layout(title: str, height: int, revision: str, subtitle: str | None = None, **kw) -> dict:
    text = title if not subtitle else f"{title}<br><sup>{subtitle}</sup>"
    lay = dict(title=dict(text=text, x=0.01, xanchor="left", font=dict(size=14)), height=int(height),
               uirevision=revision, font=FONT, plot_bgcolor="white", paper_bgcolor="white",
               margin=dict(l=60, r=20, t=64 if subtitle else 44, b=40), hovermode="closest",
               legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0, font=dict(size=11)))
    lay.update(kw)
    return lay


def _grid(layout: dict, rows: list[float], cols: list[float], vspace: float = 0.06, hspace: float = 0.08,
          share_x: bool = False, secondary: tuple = (), titles: list[str] | None = None) -> dict:
    """Manual make_subplots: axes with domains in `layout`; returns {(r, c): (xref, yref)} and
    {(r, c, 'y2'): yref} for secondary y axes. Row 1 is at the top."""
    nr, nc = len(rows), len(cols)
    hsum = sum(rows)
    wsum = sum(cols)
    avail_h = 1 - vspace * (nr - 1)
    avail_w = 1 - hspace * (nc - 1)
    refs: dict = {}
    y_top = 1.0
    k = 0
    ydoms = []
    for r in range(nr):
        h = avail_h * rows[r] / hsum
        ydoms.append((max(0.0, y_top - h), y_top))
        y_top -= h + vspace
    xdoms = []
    x0 = 0.0
    for c in range(nc):
        w = avail_w * cols[c] / wsum
        xdoms.append((x0, min(1.0, x0 + w)))
        x0 += w + hspace
    for r in range(nr):
        for c in range(nc):
            k += 1
            xn, yn = ("x", "y") if k == 1 else (f"x{k}", f"y{k}")
            xa = _axis(domain=list(xdoms[c]), anchor=yn)
            if share_x and nc == 1 and r < nr - 1:
                xa["showticklabels"] = False
            if share_x and nc == 1 and k > 1:
                xa["matches"] = "x"
            layout["xaxis" if k == 1 else f"xaxis{k}"] = xa
            layout["yaxis" if k == 1 else f"yaxis{k}"] = _axis(domain=list(ydoms[r]), anchor=xn)
            refs[(r + 1, c + 1)] = (xn, yn)
    n = nr * nc
    for (r, c) in secondary:
        n += 1
        xn, yn = refs[(r, c)]
        layout[f"yaxis{n}"] = _axis(anchor=xn, overlaying=yn, side="right", showgrid=False)
        refs[(r, c, "y2")] = f"y{n}"
    if titles:
        ann = layout.setdefault("annotations", [])
        for i, t in enumerate(titles):
            r, c = divmod(i, nc)
            if not t:
                continue
            ann.append(dict(text=t, x=sum(xdoms[c]) / 2, y=ydoms[r][1], xref="paper", yref="paper",
                            xanchor="center", yanchor="bottom", showarrow=False, font=dict(size=11)))
    return refs


def _axname(ref: str, kind: str) -> str:
    """'x2' -> 'xaxis2', 'y' -> 'yaxis'."""
    return f"{kind}axis{ref[1:]}"


def empty_spec(title: str, message: str, height: int = 260, revision: str = "empty") -> dict:
    lay = _layout(title, height, revision)
    lay.update(xaxis=dict(visible=False), yaxis=dict(visible=False),
               annotations=[dict(text=message, x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False,
                                 font=dict(size=14, color="#666"))])
    return {"data": [], "layout": lay}


def error_spec(title: str, err: BaseException | str, height: int = 260) -> dict:
    msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    msg = msg.replace("<", "&lt;")[:200]
    return empty_spec(title, f"could not draw this chart<br><sup>{msg}</sup>", height, "error")


def _owner_color_index(rid: str) -> int:
    return zlib.crc32(rid.encode()) % len(OWNER_PALETTE)


def owner_color(rid: str) -> str:
    return OWNER_PALETTE[_owner_color_index(rid)]


def _discrete_colorscale(colors: list[str]) -> list:
    k = len(colors)
    scale = []
    for i, c in enumerate(colors):
        scale += [[i / k, c], [(i + 1) / k, c]]
    return scale


# ----------------------------------------------------------------------------- 1. KV block map
def _grid_shape(n: int, max_cols: int = 64) -> tuple[int, int]:
    cols = min(max_cols, max(8, 2 ** math.ceil(math.log2(max(1.0, math.sqrt(n * 2))))))
    return math.ceil(n / cols), cols


def block_states(kv: dict) -> dict:
    """Per-block state arrays and owners from a kv snapshot (`loop.kv_snapshot()`)."""
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
    cat[ref > 1] = 2                                    # shared
    for b in np.nonzero(ref == 1)[0]:
        cat[b] = 3 + (_owner_color_index(owners[b][0]) if owners[b] else 0)
    null_free = 1 if (n and ref[0] == 0) else 0         # block 0: the reserved null block
    return dict(n=n, ref=ref, cached=cached, owners=owners, cat=cat,
                num_free=int(((ref == 0) & ~cached).sum()) - null_free,
                num_cached_free=int(((ref == 0) & cached).sum()),
                num_in_use=int(in_use.sum()), num_shared=int((ref > 1).sum()))


def block_map_spec(kv: dict | None, highlight: str | None = None, height: int | None = None,
                   max_cells: int = 4096) -> dict:
    """Every physical block of the KV pool as a cell: free / cached-free / shared / owner request.
    Pools larger than `max_cells` are drawn as cells of consecutive blocks (majority state)."""
    title = "KV block map"
    if not kv or not kv.get("num_blocks"):
        return empty_spec(title, "no KV snapshot yet", height or 300, "blockmap")
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
        for b in range(n):
            if ref[b] == 0:
                if b == 0:
                    text[b] = "block 0 · null block (reserved, never allocated)"
                    z[0] = np.nan
                else:
                    text[b] = f"block {b} · " + ("cached-free (evictable, prefix hash kept)" if cached[b] else "free")
            else:
                own = ", ".join(owners[b][:6]) + (" …" if len(owners[b]) > 6 else "")
                state = "shared" if ref[b] > 1 else "in use"
                text[b] = (f"block {b} · {state} · ref {ref[b]}{' · cached' if cached[b] else ''}"
                           f"<br>owner{'s' if len(owners[b]) > 1 else ''}: {own or '?'}")
    else:
        for c in range(cells):
            lo, hi = c * group, min(n, (c + 1) * group)
            seg = cat[lo:hi]
            used = int((ref[lo:hi] > 0).sum())
            cf = int(((ref[lo:hi] == 0) & cached[lo:hi]).sum())
            if (ref[lo:hi] > 1).any():
                z[c] = 2
            elif used > (hi - lo) / 2:
                vals, counts = np.unique(seg[seg >= 3], return_counts=True)
                z[c] = vals[np.argmax(counts)] if len(vals) else 3
            else:
                z[c] = 1 if cf > (hi - lo) / 2 else 0
            text[c] = f"blocks {lo}–{hi - 1} · {used} in use · {cf} cached-free · {hi - lo - used - cf} free"
    zg = z.reshape(rows, cols)
    data = [dict(type="heatmap", z=[_lst(r) for r in zg], text=[text[r * cols:(r + 1) * cols] for r in range(rows)],
                 hovertemplate="%{text}<extra></extra>", zmin=-0.5, zmax=N_CATS - 0.5,
                 colorscale=_discrete_colorscale(CATEGORY_COLORS), showscale=False, xgap=1, ygap=1, name="blocks")]
    for name, color in (("free", FREE_COLOR), ("cached-free", CACHED_COLOR), ("shared (ref>1)", SHARED_COLOR),
                        ("in use (colour = request)", OWNER_PALETTE[0])):
        data.append(dict(type="scatter", x=[None], y=[None], mode="markers", name=name, hoverinfo="skip",
                         marker=dict(symbol="square", size=12, color=color, line=dict(width=1, color="#999"))))
    if highlight and group == 1:
        blocks = (kv.get("block_tables") or {}).get(highlight) or []
        if blocks:
            data.append(dict(type="scatter", x=[b % cols for b in blocks], y=[b // cols for b in blocks],
                             mode="markers+text", text=[str(i) for i in range(len(blocks))],
                             textfont=dict(size=8, color="#000"), name=f"{highlight} (logical index)",
                             marker=dict(symbol="square-open", size=13, color="#000", line=dict(width=2)),
                             hovertemplate="logical block %{text}<extra>" + highlight + "</extra>"))
    used_pct = 100.0 * st["num_in_use"] / max(1, n - 1)
    sub = (f"{n} blocks × {kv.get('block_size', '?')} tokens · {st['num_in_use']} in use ({used_pct:.0f}%) · "
           f"{st['num_shared']} shared · {st['num_cached_free']} cached-free · {max(0, st['num_free'])} free"
           + (f" · 1 cell = {group} blocks" if group > 1 else "") + " · hover a cell for owners")
    h = height or int(min(560, max(240, 110 + rows * (20 if cols <= 32 else 13))))
    lay = _layout(title, h, "blockmap", sub, margin=dict(l=10, r=10, t=70, b=10),
                  xaxis=dict(visible=False, range=[-0.5, cols - 0.5]),
                  yaxis=dict(visible=False, autorange="reversed"),
                  legend=dict(orientation="h", yanchor="top", y=-0.02, xanchor="left", x=0.0, font=dict(size=11)))
    return {"data": data, "layout": lay}


def block_table_spec(kv: dict | None, request_id: str | None, height: int = 200) -> dict:
    """A request's block table: logical block i -> physical block id (colour: private / cached / shared)."""
    title = "Block table"
    if not request_id:
        return empty_spec(title, "select a request to see its block table (logical → physical)", height, "blocktable")
    table = ((kv or {}).get("block_tables") or {}).get(request_id)
    if not table:
        return empty_spec(f"{title}: {request_id}", "this request holds no KV blocks right now "
                          "(waiting, preempted or finished)", height, "blocktable")
    ref = kv.get("ref_counts") or []
    cached = kv.get("cached") or []
    bs = kv.get("block_size", 16)
    # the leading blocks a prefix-cache hit gave it at admission (recorder adds num_cached_tokens to kv)
    n_hit = min(len(table), int(((kv.get("num_cached_tokens") or {}).get(request_id) or 0)) // bs)
    cols = min(32, len(table))
    rows = math.ceil(len(table) / cols)
    z = np.full(rows * cols, np.nan)
    text = [""] * (rows * cols)
    hover = [""] * (rows * cols)
    for i, b in enumerate(table):
        r = ref[b] if b < len(ref) else 1
        c = bool(cached[b]) if b < len(cached) else False
        z[i] = 2 if r > 1 else (1 if c else 0)
        text[i] = f"{b}*" if i < n_hit else str(b)
        hover[i] = (f"logical {i} (tokens {i * bs}–{(i + 1) * bs - 1}) → physical {b}<br>ref {r}"
                    f"{' · shared' if r > 1 else ''}{' · cached (full, hashed)' if c else ''}"
                    f"{' · from the prefix cache (hit at admission)' if i < n_hit else ''}")
    zg = z.reshape(rows, cols)
    data = [dict(type="heatmap", z=[_lst(r) for r in zg], text=[text[i * cols:(i + 1) * cols] for i in range(rows)],
                 customdata=[hover[i * cols:(i + 1) * cols] for i in range(rows)], texttemplate="%{text}",
                 hovertemplate="%{customdata}<extra></extra>", zmin=-0.5, zmax=2.5, showscale=False,
                 xgap=2, ygap=2, colorscale=_discrete_colorscale([owner_color(request_id), CACHED_COLOR, SHARED_COLOR]))]
    lay = _layout(f"{title}: {request_id}", max(height, 130 + 28 * rows), "blocktable",
                  f"{len(table)} blocks · {n_hit} from the prefix cache (*) · cell = physical block id · "
                  f"row r, column c = logical block r·{cols}+c · colours: private / cached (full, hashed) / shared",
                  xaxis=_axis(title=dict(text="logical block"), dtick=1 if cols <= 16 else 4),
                  yaxis=dict(visible=False, autorange="reversed"))
    return {"data": data, "layout": lay}


# ----------------------------------------------------------------------------- 2. scheduler timeline
def timeline_spec(snap: Snapshot, axis: str = "time", max_requests: int = 40, max_steps: int = 400,
                  height: int | None = None) -> dict:
    """Gantt of the latest requests (waiting / prefill / decode / preempted spans) over time or engine
    steps, and below it the per-step batch composition (prefill vs decode tokens, running / waiting)."""
    by_step = axis == "step"
    reqs = [r for r in snap.requests if r.spans][-max_requests:]
    title = "Scheduler timeline"
    if not reqs and not snap.steps:
        return empty_spec(title, "no requests yet — send a prompt or start a load", height or 420, "timeline")
    t0 = snap.t0
    n_all = sum(1 for r in snap.requests if r.spans)
    steps = snap.steps[-max_steps:]
    h = height or int(min(900, max(440, 220 + 16 * len(reqs))))
    lay = _layout(title, h, f"timeline-{axis}",
                  f"latest {len(reqs)} of {n_all} requests · last {len(steps)} steps · "
                  "waiting / prefill (chunks) / decode / preempted", margin=dict(l=90, r=50, t=70, b=40),
                  barmode="stack", bargap=0.15)
    refs = _grid(lay, rows=[0.72, 0.28], cols=[1.0], vspace=0.05, share_x=True, secondary=((2, 1),))
    (x1, y1), (x2, y2), y2b = refs[(1, 1)], refs[(2, 1)], refs[(2, 1, "y2")]
    data: list[dict] = []
    for phase in ("waiting", "prefill", "decode", "preempted"):
        ys, xs, bases, hov = [], [], [], []
        for r in reqs:
            for sp in r.spans:
                if sp.phase != phase:
                    continue
                a, b = (sp.step_start, sp.step_end) if by_step else (sp.start - t0, sp.end - t0)
                if b - a <= 0 and phase in ("waiting", "preempted"):
                    continue
                ys.append(r.request_id)
                bases.append(a)
                xs.append(max(b - a, 0.05 if by_step else 1e-4))
                extra = f" · {sp.num_tokens} tok" if sp.num_tokens else ""
                note = f" ({sp.note})" if sp.note else ""
                hov.append(f"{r.request_id} · {phase}{note}{extra}<br>{sp.start - t0:.3f}–{sp.end - t0:.3f} s "
                           f"({(sp.end - sp.start) * 1e3:.1f} ms) · steps {sp.step_start:.0f}–{sp.step_end:.0f}")
        data.append(dict(type="bar", orientation="h", y=ys, x=xs, base=bases, name=phase, hovertext=hov,
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
                                    + (f" · {r.num_preemptions} preemptions" if r.num_preemptions else "") for r in ends],
                         hoverinfo="text"))
    if steps:
        if by_step:
            x = [s.step + 0.5 for s in steps]
            w = [1.0] * len(steps)
        else:
            x = [(s.start + s.end) / 2 - t0 for s in steps]
            w = [max(1e-4, s.end - s.start) for s in steps]
        hov = [f"step {s.step}: {len(s.scheduled)} seqs, {s.num_prefill_tokens}+{s.num_decode_tokens} tok, "
               f"{(s.end - s.start) * 1e3:.1f} ms{' (graph)' if s.cuda_graph else ''}"
               + (f"<br>preempted {', '.join(s.preempted[:4])}" if s.preempted else "") for s in steps]
        data.append(dict(type="bar", x=x, y=[s.num_prefill_tokens for s in steps], width=w, name="prefill tokens",
                         marker=dict(color=PHASE_COLORS["prefill"], line=dict(width=0)), hovertext=hov,
                         hoverinfo="text", showlegend=False, xaxis=x2, yaxis=y2))
        data.append(dict(type="bar", x=x, y=[s.num_decode_tokens for s in steps], width=w, name="decode tokens",
                         marker=dict(color=PHASE_COLORS["decode"], line=dict(width=0)), hovertext=hov,
                         hoverinfo="text", showlegend=False, xaxis=x2, yaxis=y2))
        data.append(dict(type="scatter", x=x, y=[s.num_running for s in steps], mode="lines", name="running",
                         line=dict(color="#222", width=1.5, shape="hv"), xaxis=x2, yaxis=y2b))
        data.append(dict(type="scatter", x=x, y=[s.num_waiting for s in steps], mode="lines", name="waiting (queue)",
                         line=dict(color="#888", width=1.5, dash="dot", shape="hv"), xaxis=x2, yaxis=y2b))
        pre = [(xx, s) for xx, s in zip(x, steps) if s.preempted]
        if pre:
            data.append(dict(type="scatter", mode="markers", name="preemption", xaxis=x2, yaxis=y2,
                             x=[p[0] for p in pre], y=[p[1].num_prefill_tokens + p[1].num_decode_tokens for p in pre],
                             marker=dict(symbol="triangle-down", color=PHASE_COLORS["preempted"], size=10),
                             hovertext=[f"step {p[1].step}: preempted {', '.join(p[1].preempted)}" for p in pre],
                             hoverinfo="text"))
    lay[_axname(y1, "y")].update(type="category", categoryorder="array",
                                 categoryarray=[r.request_id for r in reversed(reqs)], tickfont=dict(size=9))
    lay[_axname(y2, "y")].update(title=dict(text="tokens/step"))
    lay[_axname(y2b, "y")].update(title=dict(text="seqs"), rangemode="tozero", tickformat="d")
    lay[_axname(x2, "x")].update(title=dict(text="engine step" if by_step else "seconds since first event"))
    return {"data": data, "layout": lay}


# ----------------------------------------------------------------------------- 3. per-step timings
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


# ----------------------------------------------------------------------------- 4. speculative decoding
def spec_spec(snap: Snapshot, height: int = 320, window: int = 20) -> dict:
    title = "Speculative decoding"
    sp = snap.spec or {}
    if not sp.get("num_drafts"):
        return empty_spec(title, "speculative decoding is not enabled — set speculative_method "
                          "(ngram / draft / self) in Engine settings", height, "spec")
    drafts = sp["num_drafts"]
    rate = sp["num_accepted_tokens"] / max(1, sp["num_draft_tokens"])
    mean_len = 1 + sp["num_accepted_tokens"] / max(1, drafts)
    lay = _layout(title, height, "spec",
                  f"acceptance rate {rate:.1%} (accepted / drafted) · mean acceptance length {mean_len:.2f} "
                  f"(1 + accepted / drafts) · {drafts} drafts, {sp['num_draft_tokens']} draft tokens",
                  margin=dict(l=60, r=60, t=80, b=40), showlegend=False)
    refs = _grid(lay, rows=[1.0], cols=[0.36, 0.64], hspace=0.1, secondary=((1, 2),),
                 titles=["acceptance rate per draft position",
                         f"over steps (rolling {window}): <span style='color:#59A14F'>acceptance rate</span> · "
                         "<span style='color:#4E79A7'>mean acceptance length</span> (right)"])
    (xa, ya), (xb, yb), yb2 = refs[(1, 1)], refs[(1, 2)], refs[(1, 2, "y2")]
    per = sp.get("accepted_per_pos") or []
    data = [dict(type="bar", x=[f"pos {i + 1}" for i in range(len(per))], y=[v / drafts for v in per],
                 marker=dict(color="#59A14F"), name="accepted / drafts", showlegend=False,
                 hovertemplate="%{x}: %{y:.1%}<extra></extra>", xaxis=xa, yaxis=ya)]
    hist = sp.get("history") or []
    if hist:
        arr = np.asarray([(h[0], h[2], h[3], h[4]) for h in hist], dtype=np.float64)
        k = min(window, len(arr))
        kern = np.ones(k)
        d = np.convolve(arr[:, 1], kern, "valid")
        dt = np.convolve(arr[:, 2], kern, "valid")
        acc = np.convolve(arr[:, 3], kern, "valid")
        x = arr[k - 1:, 0]
        data.append(dict(type="scatter", x=_lst(x), y=_lst(acc / np.maximum(dt, 1)), name="acceptance rate",
                         mode="lines", line=dict(color="#59A14F"), xaxis=xb, yaxis=yb))
        data.append(dict(type="scatter", x=_lst(x), y=_lst(1 + acc / np.maximum(d, 1)), name="mean acceptance length",
                         mode="lines", line=dict(color="#4E79A7"), xaxis=xb, yaxis=yb2))
    lay[_axname(ya, "y")].update(range=[0, 1.05], tickformat=".0%")
    lay[_axname(yb, "y")].update(range=[0, 1.05], tickformat=".0%", title=dict(text="acceptance rate"))
    lay[_axname(yb2, "y")].update(title=dict(text="tokens / draft"), rangemode="tozero")
    lay[_axname(xb, "x")].update(title=dict(text="engine step"))
    return {"data": data, "layout": lay}


# ----------------------------------------------------------------------------- 5. latency / throughput
def histogram(values: np.ndarray, bins: int = 30) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin centres, counts, widths), clipped at the 99.5th percentile so one outlier cannot flatten it."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0)
    hi = float(np.percentile(v, 99.5)) if v.size > 50 else float(v.max())
    lo = float(v.min())
    if hi <= lo:
        hi = lo + max(1e-3, abs(lo) * 1e-3)
    counts, edges = np.histogram(np.clip(v, lo, hi), bins=bins, range=(lo, hi))
    return (edges[:-1] + edges[1:]) / 2, counts, np.diff(edges)


def latency_spec(records, height: int = 300, bins: int = 30) -> dict:
    """TTFT / TPOT / ITL / E2EL histograms (binned here; the browser only gets the bars)."""
    title = "Latency distributions"
    done = M.completed(records)
    if not done:
        return empty_spec(title, "no finished requests yet", height, "latency")
    df = M.request_frame(done)
    series = {"TTFT": df["ttft"].to_numpy() * 1e3, "TPOT": df["tpot"].to_numpy() * 1e3,
              "ITL": M.itl_values(done) * 1e3, "E2EL": df["e2el"].to_numpy() * 1e3}
    titles = []
    for name, v in series.items():
        s = M.stats(v, scale=1.0)
        titles.append(f"<b>{name}</b> p50 {s['p50']:.1f} · p99 {s['p99']:.1f} ms" if s["n"] else f"<b>{name}</b> —")
    lay = _layout(title, height, "latency", f"{len(done)} finished requests · TTFT arrival→first token · "
                  "TPOT (E2EL−TTFT)/(n−1) · ITL gap between outputs · E2EL arrival→last token",
                  margin=dict(l=50, r=20, t=90, b=40), bargap=0.02, showlegend=False)
    refs = _grid(lay, rows=[1.0], cols=[1, 1, 1, 1], hspace=0.05, titles=titles)
    colors = {"TTFT": "#F28E2B", "TPOT": "#4E79A7", "ITL": "#76B7B2", "E2EL": "#B07AA1"}
    data = []
    for i, (name, v) in enumerate(series.items(), start=1):
        c, n, w = histogram(v, bins)
        xa, ya = refs[(1, i)]
        data.append(dict(type="bar", x=_lst(c), y=n.tolist(), width=_lst(w), name=name, xaxis=xa, yaxis=ya,
                         marker=dict(color=colors[name], line=dict(width=0)),
                         hovertemplate=f"{name} %{{x:.2f}} ms: %{{y}}<extra></extra>"))
        lay[_axname(xa, "x")].update(title=dict(text="ms"))
    return {"data": data, "layout": lay}


def _nice(width: float) -> float:
    e = 10 ** math.floor(math.log10(width))
    for m in (1, 2, 5, 10):
        if m * e >= width:
            return m * e
    return 10 * e


def throughput_spec(snap: Snapshot, height: int = 340, max_bins: int = 120) -> dict:
    """Prompt / generation tok/s over time (binned from step events), KV usage, prefix-cache hit rate per
    bin (cached / queried prompt tokens of the requests admitted in it) and running / waiting."""
    title = "Throughput and KV usage"
    steps = snap.steps
    if not steps:
        return empty_spec(title, "no engine steps yet", height, "throughput")
    t0 = snap.t0
    ends = np.asarray([s.end - t0 for s in steps])
    first = steps[0].start - t0
    width = _nice(max(0.1, max(ends[-1] - first, 1e-3) / max_bins))
    start = math.floor(first / width) * width
    idx = np.floor((ends - start) / width).astype(int)
    nb = int(idx.max()) + 1
    prompt = np.bincount(idx, weights=[s.num_prefill_tokens for s in steps], minlength=nb)
    gen = np.bincount(idx, weights=[step_output_tokens(s) for s in steps], minlength=nb)
    queries = np.bincount(idx, weights=[s.prefix_cache_queries for s in steps], minlength=nb)
    hits = np.bincount(idx, weights=[s.prefix_cache_hits for s in steps], minlength=nb)
    hit_pct = np.where(queries > 0, 100 * hits / np.maximum(queries, 1), np.nan)   # gaps where nothing arrived
    xb = start + (np.arange(nb) + 0.5) * width
    tot = snap.totals
    lay = _layout(title, height, "throughput",
                  f"{tot.get('output_tokens', 0)} tokens generated · {tot.get('prompt_tokens', 0)} prompt tokens computed · "
                  f"{tot.get('preemptions', 0)} preemptions · prefix-cache hits {tot.get('prefix_cache_hits', 0)}/"
                  f"{tot.get('prefix_cache_queries', 0)} tokens · bins of {width:g} s",
                  margin=dict(l=60, r=50, t=70, b=40))
    refs = _grid(lay, rows=[0.55, 0.45], cols=[1.0], vspace=0.07, share_x=True, secondary=((2, 1),))
    (x1, y1), (x2, y2), y2b = refs[(1, 1)], refs[(2, 1)], refs[(2, 1, "y2")]
    sub = steps[-2000:]
    sub = sub[::max(1, math.ceil(len(sub) / 600))]          # at most ~600 points per line
    xs = [s.end - t0 for s in sub]
    data = [
        dict(type="scatter", x=_lst(xb), y=_lst(gen / width), name="generation tok/s", mode="lines",
             line=dict(color="#4E79A7", width=2, shape="hvh"), xaxis=x1, yaxis=y1),
        dict(type="scatter", x=_lst(xb), y=_lst(prompt / width), name="prompt tok/s", mode="lines",
             line=dict(color="#F28E2B", width=1.5, shape="hvh"), xaxis=x1, yaxis=y1),
        dict(type="scatter", x=xs, y=[100 * s.kv_usage for s in sub], name="KV usage %", mode="lines",
             line=dict(color="#E15759", width=1.5), fill="tozeroy", fillcolor="rgba(225,87,89,0.12)", xaxis=x2, yaxis=y2),
        dict(type="scatter", x=_lst(xb), y=_lst(hit_pct), name="prefix-cache hit %", mode="lines+markers",
             line=dict(color="#59A14F", width=1.5), marker=dict(size=4), connectgaps=False, xaxis=x2, yaxis=y2,
             hovertemplate="%{y:.0f}% of the prompt tokens admitted in this bin were cached<extra></extra>"),
        dict(type="scatter", x=xs, y=[s.num_running for s in sub], name="running", mode="lines",
             line=dict(color="#222", width=1, shape="hv"), xaxis=x2, yaxis=y2b),
        dict(type="scatter", x=xs, y=[s.num_waiting for s in sub], name="waiting", mode="lines",
             line=dict(color="#888", width=1, dash="dot", shape="hv"), xaxis=x2, yaxis=y2b),
    ]
    lay[_axname(y1, "y")].update(title=dict(text="tok/s"), rangemode="tozero")
    lay[_axname(y2, "y")].update(title=dict(text="KV % · hit %"), range=[0, 105])
    lay[_axname(y2b, "y")].update(title=dict(text="seqs"), rangemode="tozero", tickformat="d")
    lay[_axname(x2, "x")].update(title=dict(text="seconds since first event"))
    return {"data": data, "layout": lay}


# ----------------------------------------------------------------------------- public figure API
def _fig(spec_fn):
    def build(*a, **kw):
        return as_figure(spec_fn(*a, **kw))
    build.__name__ = spec_fn.__name__.replace("_spec", "_figure")
    build.__doc__ = (spec_fn.__doc__ or "") + "\n\nReturns a plotly.graph_objects.Figure."
    return build


block_map_figure = _fig(block_map_spec)
block_table_figure = _fig(block_table_spec)
timeline_figure = _fig(timeline_spec)
timings_figure = _fig(timings_spec)
profile_figure = _fig(profile_spec)
spec_figure = _fig(spec_spec)
latency_figure = _fig(latency_spec)
throughput_figure = _fig(throughput_spec)
empty_figure = _fig(empty_spec)
error_figure = _fig(error_spec)

SPECS: dict[str, Callable[[Snapshot], dict]] = {
    "block_map": lambda snap: block_map_spec(snap.kv),
    "timeline": lambda snap: timeline_spec(snap, axis="time"),
    "timeline_step": lambda snap: timeline_spec(snap, axis="step"),
    "timings": timings_spec,
    "spec": spec_spec,
    "latency": lambda snap: latency_spec(snap.records),
    "throughput": throughput_spec,
}
TITLES = {"block_map": "KV block map", "timeline": "Scheduler timeline", "timeline_step": "Scheduler timeline",
          "timings": "Per-step timings", "spec": "Speculative decoding", "latency": "Latency distributions",
          "throughput": "Throughput and KV usage"}


def build_specs(snap: Snapshot, names: list[str] | None = None) -> dict[str, dict]:
    """Every inspector chart for one snapshot as specs; a failing builder yields an error chart, never raises."""
    out: dict[str, dict] = {}
    for name in names or list(SPECS):
        try:
            out[name] = SPECS[name](snap)
        except Exception as e:  # one broken chart never takes the others down
            log.exception("figure %s failed", name)
            out[name] = error_spec(TITLES.get(name, name), e)
    return out


def build_all(snap: Snapshot, names: list[str] | None = None) -> dict:
    """Every inspector chart as plotly Figures (notebooks)."""
    return {k: as_figure(v) for k, v in build_specs(snap, names).items()}
