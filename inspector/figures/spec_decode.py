"""Speculative decoding: acceptance rate per draft position and over steps, and when auto-off stopped drafting."""
from __future__ import annotations

import numpy as np

from inspector.figures.layout import _axname, _fig, _grid, _layout, _lst, empty_spec
from inspector.recorder import Snapshot


def spec_spec(snap: Snapshot, height: int = 320, window: int = 20) -> dict:
    title = "Speculative decoding"
    sp = snap.spec or {}
    if not sp.get("num_drafts"):
        if sp.get("num_steps"):
            return empty_spec(title, "no drafts yet: the drafter found nothing to propose, or auto-off "
                              "(speculative_auto_off) judged drafting not worth its cost", height, "spec")
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
                         "<span style='color:#4E79A7'>mean acceptance length</span> (right) · "
                         "<span style='color:#BAB0AC'>requests with drafting off</span>"])
    (xa, ya), (xb, yb), yb2 = refs[(1, 1)], refs[(1, 2)], refs[(1, 2, "y2")]
    per = sp.get("accepted_per_pos") or []
    data = [dict(type="bar", x=[f"pos {i + 1}" for i in range(len(per))], y=[v / drafts for v in per],
                 marker=dict(color="#59A14F"), name="accepted / drafts", showlegend=False,
                 hovertemplate="%{x}: %{y:.1%}<extra></extra>", xaxis=xa, yaxis=ya)]
    hist = sp.get("history") or []
    if hist:
        arr = np.asarray([(h[0], h[2], h[3], h[4]) for h in hist], dtype=np.float64)
        off = np.asarray([(h[5], h[6]) if len(h) > 6 else (0, 0) for h in hist], dtype=np.float64)
        if off[:, 0].any():          # auto-off: share of decoding requests not drafting, per step
            data.append(dict(type="scatter", x=_lst(arr[:, 0]), y=_lst(off[:, 0] / np.maximum(off[:, 1], 1)),
                             name="requests with drafting off", mode="lines", fill="tozeroy",
                             line=dict(color="#BAB0AC", width=0, shape="hv"), fillcolor="rgba(186,176,172,0.35)",
                             hovertemplate="step %{x}: %{y:.0%} of decoding requests not drafting (auto-off)"
                                           "<extra></extra>", xaxis=xb, yaxis=yb))
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


spec_figure = _fig(spec_spec)
