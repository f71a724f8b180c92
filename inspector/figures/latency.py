"""Latency distributions (TTFT / TPOT / ITL / E2EL histograms) and throughput / KV usage over time."""
from __future__ import annotations

import math

import numpy as np

from inspector import metrics as M
from inspector.figures.layout import LEGEND_ROOM, _axname, _fig, _grid, _layout, _lst, empty_spec, thin
from inspector.figures.style import replica_color
from inspector.recorder import Snapshot, steps_by_replica
from inspector.tracks import step_output_tokens


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


def _ms(x: float) -> str:
    return f"{x / 1000:.2f} s" if x >= 1000 else (f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms")


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
    for name, v in series.items():     # two short lines each, so four fit side by side in a narrow figure
        s = M.stats(v, scale=1.0)
        titles.append(f"<b>{name}</b><br>p50 {_ms(s['p50'])} · p99 {_ms(s['p99'])}" if s["n"] else f"<b>{name}</b><br>—")
    lay = _layout(title, height, "latency", f"{len(done)} finished requests · TTFT arrival→first token · "
                  "TPOT (E2EL−TTFT)/(n−1) · ITL gap between outputs · E2EL arrival→last token",
                  margin=dict(l=50, r=20, t=100, b=40), bargap=0.02, showlegend=False)
    refs = _grid(lay, rows=[1.0], cols=[1, 1, 1, 1], hspace=0.06, titles=titles)
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


def throughput_spec(snap: Snapshot, height: int = 380, max_bins: int = 120) -> dict:
    """Prompt / generation tok/s over time (binned from step events), KV usage, prefix-cache hit rate per
    bin (cached / queried prompt tokens of the requests admitted in it) and running / waiting (each
    data-parallel replica's own)."""
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
                  margin=dict(l=60, r=50, t=70, b=40 + LEGEND_ROOM))
    refs = _grid(lay, rows=[0.55, 0.45], cols=[1.0], vspace=0.07, share_x=True, secondary=((2, 1),))
    (x1, y1), (x2, y2), y2b = refs[(1, 1)], refs[(2, 1)], refs[(2, 1, "y2")]
    data = [
        dict(type="scatter", x=_lst(xb), y=_lst(gen / width), name="generation tok/s", mode="lines",
             line=dict(color="#4E79A7", width=2, shape="hvh"), xaxis=x1, yaxis=y1),
        dict(type="scatter", x=_lst(xb), y=_lst(prompt / width), name="prompt tok/s", mode="lines",
             line=dict(color="#F28E2B", width=1.5, shape="hvh"), xaxis=x1, yaxis=y1),
    ]
    n = snap.num_replicas
    if n == 1:
        sub = thin(steps, 600)
        xs = [s.end - t0 for s in sub]
        usage = [dict(type="scatter", x=xs, y=[100 * s.kv_usage for s in sub], name="KV usage %", mode="lines",
                      line=dict(color="#E15759", width=1.5), fill="tozeroy", fillcolor="rgba(225,87,89,0.12)",
                      xaxis=x2, yaxis=y2)]
        queue = [dict(type="scatter", x=xs, y=[s.num_running for s in sub], name="running", mode="lines",
                      line=dict(color="#222", width=1, shape="hv"), xaxis=x2, yaxis=y2b),
                 dict(type="scatter", x=xs, y=[s.num_waiting for s in sub], name="waiting", mode="lines",
                      line=dict(color="#888", width=1, dash="dot", shape="hv"), xaxis=x2, yaxis=y2b)]
    else:       # data parallelism: each replica's KV usage and queue, in its colour
        usage, queue = [], []
        for r, mine in enumerate(steps_by_replica(steps, n)):
            sub = thin(mine, 600 // n)
            xs, c = [s.end - t0 for s in sub], replica_color(r)
            usage.append(dict(type="scatter", x=xs, y=[100 * s.kv_usage for s in sub], name=f"replica {r} KV usage %",
                              mode="lines", line=dict(color=c, width=1.5), xaxis=x2, yaxis=y2))
            queue += [dict(type="scatter", x=xs, y=[s.num_running for s in sub], name=f"replica {r} running",
                           mode="lines", line=dict(color=c, width=1, shape="hv"), xaxis=x2, yaxis=y2b),
                      dict(type="scatter", x=xs, y=[s.num_waiting for s in sub], name=f"replica {r} waiting",
                           mode="lines", line=dict(color=c, width=1, dash="dot", shape="hv"), xaxis=x2, yaxis=y2b)]
    data += usage + [
        dict(type="scatter", x=_lst(xb), y=_lst(hit_pct), name="prefix-cache hit %", mode="lines+markers",
             line=dict(color="#59A14F", width=1.5), marker=dict(size=4), connectgaps=False, xaxis=x2, yaxis=y2,
             hovertemplate="%{y:.0f}% of the prompt tokens admitted in this bin were cached<extra></extra>"),
    ] + queue
    lay[_axname(y1, "y")].update(title=dict(text="tok/s"), rangemode="tozero")
    lay[_axname(y2, "y")].update(title=dict(text="KV % · hit %"), range=[0, 105])
    lay[_axname(y2b, "y")].update(title=dict(text="seqs"), rangemode="tozero", tickformat="d")
    lay[_axname(x2, "x")].update(title=dict(text="seconds since first event"))
    return {"data": data, "layout": lay}


latency_figure = _fig(latency_spec)
throughput_figure = _fig(throughput_spec)
