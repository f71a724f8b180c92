"""Results as Markdown, HTML, tables and Plotly payloads for the UI."""
from __future__ import annotations

import html
import json
import math
from typing import Any

from gradio.components.plot import PlotData

from inspector import figures as F
from inspector import metrics as M


# Run on a tab's .select: a Plotly chart drawn or updated while its tab was hidden had no width to measure and
# kept Plotly's default; its responsive handler skips hidden charts, so send it a resize once the tab shows.
RESIZE_PLOTS_JS = """() => {
  const go = () => window.dispatchEvent(new Event('resize'));
  requestAnimationFrame(go); setTimeout(go, 200); setTimeout(go, 800);
}"""


def plot(js: str):
    return PlotData(type="plotly", plot=js)


def spec_plot(spec: dict):
    return plot(F.to_json(spec))


def _fmt_ms(x) -> str:
    return "—" if x is None else (f"{x:,.1f} ms" if x < 10_000 else f"{x / 1000:,.2f} s")


def request_stats_md(out, request_id: str) -> str:
    s = M.request_stats(out)
    tps = "—" if s["decode_tok_s"] is None else f"{s['decode_tok_s']:,.1f}"
    state = out.finish_reason or "running"
    return ("| request | state | TTFT | TPOT | decode tok/s | prompt tok | output tok | cached tok | preemptions |\n"
            "|---|---|---|---|---|---|---|---|---|\n"
            f"| `{request_id}` | {state} | {_fmt_ms(s['ttft_ms'])} | {_fmt_ms(s['tpot_ms'])} | {tps} | "
            f"{s['prompt_tokens']} | {s['output_tokens']} | {s['cached_tokens']} | {s['preemptions']} |\n\n"
            "<sub>TTFT: arrival → first token · TPOT: (E2EL − TTFT) / (output tokens − 1) · decode tok/s: "
            "(output tokens − 1) / (last − first token time) · cached: prompt tokens from the prefix cache</sub>")


def logprobs_rows(out, limit: int = 512) -> list[list]:
    rows = []
    lps = out.logprobs or []
    for i, entry in enumerate(lps[:limit]):
        if not entry:
            continue
        chosen = entry[0]
        alts = " · ".join(f"{a.decoded!r} {a.logprob:.2f}" for a in entry[1:])
        rows.append([i, repr(chosen.decoded), round(chosen.logprob, 4), round(math.exp(chosen.logprob), 4), alts])
    return rows


def progress_html(p: dict | None) -> str:
    if not p:
        return "<div class='kv-progress'><span>No load has run yet.</span></div>"
    pct = 100.0 * p["fraction"]
    state = ("stopped" if p["stopped"] else "done") if p["done"] else "running"
    err = ""
    if p.get("errors"):
        err = "<div class='kv-err'>" + "<br>".join(html.escape(e) for e in p["errors"][-3:]) + "</div>"
    return (f"<div class='kv-progress' data-state='{state}'><div class='kv-bar'><div style='width:{pct:.1f}%'></div></div>"
            f"<span>{html.escape(p['name'])} — <b>{state}</b>: {p['finished']}/{p['total']} finished · "
            f"{p['in_flight']} in flight · {p['failed']} failed/cancelled · {p['elapsed_s']:.1f} s</span>{err}</div>")


def summary_md(s: dict) -> str:
    if not s:
        return ""
    gp = "" if s.get("goodput") is None else f" · goodput **{s['goodput']:.2f} req/s** ({s['good_requests']} met the SLOs)"
    return (f"**{s['completed']}/{s['num_requests']} completed** in {s['duration_s']:.2f} s · "
            f"**{s['output_throughput']:.1f} output tok/s** · {s['request_throughput']:.2f} req/s{gp} · "
            f"{s['preemptions']} preemptions · prefix-cache hit rate {100 * s['prefix_cache_hit_rate']:.1f}%")


def compare_table(results: dict[str, dict]) -> "Any":
    import pandas as pd
    labels = list(results)
    rows = []

    def add(name, fn, fmt="{:,.2f}", better="lower"):
        vals = []
        for lb in labels:
            try:
                vals.append(fn(results[lb]))
            except Exception:
                vals.append(None)
        row = {"Metric": name}
        for lb, v in zip(labels, vals):
            row[lb] = "—" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(v)
        if len(vals) == 2 and all(isinstance(v, (int, float)) and not math.isnan(v) for v in vals) and vals[0]:
            row["B / A"] = f"{vals[1] / vals[0]:.2f}×"
        else:
            row["B / A"] = ""
        row["Better"] = better
        rows.append(row)

    for m in M.LATENCY_METRICS:
        for p in ("mean", "p50", "p99"):
            add(f"{m} {p} (ms)", lambda s, m=m, p=p: s[m][p])
    add("Output throughput (tok/s)", lambda s: s["output_throughput"], "{:,.1f}", "higher")
    add("Request throughput (req/s)", lambda s: s["request_throughput"], better="higher")
    add("Goodput (req/s)", lambda s: s["goodput"], better="higher")
    add("Duration (s)", lambda s: s["duration_s"])
    add("Preemptions", lambda s: s["preemptions"], "{:,.0f}")
    add("Prefix cache hit rate (%)", lambda s: 100 * s["prefix_cache_hit_rate"], "{:,.1f}", "higher")
    add("Engine steps", lambda s: s["steps"], "{:,.0f}")
    add("Mean step (ms)", lambda s: s["mean_step_ms"])
    add("Completed", lambda s: s["completed"], "{:,.0f}", "higher")
    return pd.DataFrame(rows)


def tool_calls_md(content: str | None, calls: list[dict], constraint: dict | None) -> str:
    """A finished chat reply that offered tools, as the chat shows it: its text, each parsed call (name and
    JSON arguments) and, when tool_choice forced a call, the JSON-schema grammar that masked every token."""
    parts = [content] if content else []
    for c in calls:
        parts.append(f"**tool call** `{c['name']}`\n```json\n{c['arguments']}\n```")
    if not calls:
        parts.append("*(no tool call)*")
    if constraint is not None:
        schema = json.dumps(constraint.get("json"), indent=1, ensure_ascii=False)
        parts.append(f"<details><summary>grammar that enforced the call (JSON schema)</summary>\n\n```json\n{schema}"
                     "\n```\n</details>")
    return "\n\n".join(parts)
