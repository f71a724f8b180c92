"""Plumbing shared by every figure builder: JSON-safe specs, the common layout, a manual subplot grid,
empty / error placeholder charts, and the spec -> plotly Figure wrapper."""
from __future__ import annotations

import json
import math

import numpy as np

from inspector.figures.style import FONT, GRID


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


def thin(steps: list, points: int = 600) -> list:
    """The latest 2,000 steps, every k-th so that about `points` remain (one line's samples)."""
    sub = steps[-2000:]
    return sub[::max(1, math.ceil(len(sub) / max(1, points)))]


def _axis(**kw) -> dict:
    d = dict(gridcolor=GRID, zerolinecolor="#DDDDDD", linecolor="#CCCCCC", automargin=True)
    d.update(kw)
    return d


# a horizontal legend on the figure's bottom edge (container coordinates), below the x-axis title: a legend above
# the plot runs into the title on narrow figures; figures with one leave LEGEND_ROOM px at the bottom
LEGEND_BELOW = dict(orientation="h", yref="container", y=0.0, yanchor="bottom", xanchor="left", x=0.0)
LEGEND_ROOM = 34


def _layout(title: str, height: int, revision: str, subtitle: str | None = None, **kw) -> dict:
    text = title if not subtitle else f"{title}<br><sup>{subtitle}</sup>"
    lay = dict(title=dict(text=text, x=0.01, xanchor="left", font=dict(size=14)), height=int(height),
               uirevision=revision, font=FONT, plot_bgcolor="white", paper_bgcolor="white",
               margin=dict(l=60, r=20, t=64 if subtitle else 44, b=40), hovermode="closest",
               legend=dict(LEGEND_BELOW, font=dict(size=11)))
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


def _fig(spec_fn):
    def build(*a, **kw):
        return as_figure(spec_fn(*a, **kw))
    build.__name__ = spec_fn.__name__.replace("_spec", "_figure")
    build.__doc__ = (spec_fn.__doc__ or "") + "\n\nReturns a plotly.graph_objects.Figure."
    return build


empty_figure = _fig(empty_spec)
error_figure = _fig(error_spec)
