"""Build assets/inspector_example.ipynb: run its cells here, and store each figure's output as a PNG
(rendered by Chromium, so it shows on GitHub) next to Plotly's own JSON (interactive in Jupyter).

    python assets/build_inspector_notebook.py [--model dummy:tiny|bundled] [--no-run]

Needs /usr/bin/chromium and playwright for the PNGs (without them the notebook is written without outputs).
"""
from __future__ import annotations

import argparse
import ast
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "assets" / "inspector_example.ipynb"
CHROMIUM = "/usr/bin/chromium"

CELLS = [
    ("markdown", """# kvscope inspector in a notebook

The inspector has no Gradio inside: the same recorder, metrics, load generator and Plotly figures the app
uses work from a notebook. This one starts an engine, drives it with simulated users on a KV pool small
enough to force preemption, and draws what happened."""),
    ("code", """import math
from engine import EngineConfig
from engine.runtime.async_engine import EngineLoop
from inspector import Recorder
from inspector import export as X, figures as F, load as L, metrics as M

MODEL = "dummy:tiny"   # None: the bundled SmolLM2-135M-Instruct (real text); "dummy:tiny": random weights, fast
loop = EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=48, max_num_seqs=16)).start()
rec = Recorder().attach(loop.engine.events)   # listens to the engine's StepEvents and RequestEvents
print(loop.stats())"""),
    ("markdown", """## Simulated users
The *memory pressure* preset sizes requests so that their KV blocks outgrow the pool: the scheduler has to
preempt (free a request's blocks and recompute it later). We keep the KV snapshot with the most blocks in use."""),
    ("code", """spec = L.preset("Memory pressure (preemption)", L.EngineInfo.from_loop(loop), num_requests=12, seed=0)
runner = L.LoadRunner(loop, spec, recorder=rec, slo=M.SLO(ttft_ms=500)).start()
peak = None
while not runner.wait(0.02):
    kv = loop.kv_snapshot()
    if peak is None or sum(c > 0 for c in kv["ref_counts"]) > sum(c > 0 for c in peak["ref_counts"]):
        peak = kv
M.summary_table(runner.summary())"""),
    ("markdown", "## KV block map at peak usage (colour = owning request, purple = shared)"),
    ("code", """snap = rec.snapshot(kv=peak)
F.block_map_figure(snap.kv)"""),
    ("markdown", "## Scheduler timeline: waiting, prefill chunks, decode, preemptions; batch composition below"),
    ("code", "F.timeline_figure(snap)"),
    ("code", "F.throughput_figure(snap)"),
    ("code", "F.latency_figure(snap.records)"),
    ("code", "F.timings_figure(snap)"),
    ("markdown", "## Export: per-request metrics (CSV) and a Chrome trace for Perfetto"),
    ("code", """csv_text = X.metrics_csv(snap.records)
trace = X.chrome_trace(snap)
print(csv_text.splitlines()[0])
print(len(trace["traceEvents"]), "trace events")"""),
    ("code", """rec.detach()
loop.shutdown()"""),
]


def _split(src: str):
    """(body, last expression or None) so the cell's value can be captured like Jupyter does."""
    tree = ast.parse(src)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        body = ast.Module(tree.body[:-1], type_ignores=[])
        return compile(body, "<cell>", "exec"), compile(last, "<cell>", "eval")
    return compile(tree, "<cell>", "exec"), None


def run_cells(cells, model: str | None = "dummy:tiny", capture=True) -> list:
    """Execute the code cells in one namespace; return each code cell's (stdout, value)."""
    import contextlib
    import io
    ns: dict = {}
    results = []
    for kind, src in cells:
        if kind != "code":
            continue
        if model != "dummy:tiny":
            src = src.replace('MODEL = "dummy:tiny"', f"MODEL = {model!r}")
        body, last = _split(src)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(body, ns)
            value = eval(last, ns) if last is not None else None
        results.append((buf.getvalue(), value))
    return results


def _png(fig, page, tmp: Path) -> str:
    html = tmp / "fig.html"
    fig.write_html(str(html), include_plotlyjs=str(tmp / "plotly.min.js"), full_html=True,
                   config={"displayModeBar": False})
    page.goto(html.as_uri())
    page.wait_for_selector(".js-plotly-plot .main-svg")
    page.wait_for_timeout(200)
    return base64.b64encode(page.locator(".js-plotly-plot").first.screenshot()).decode()


def build(model: str | None, run: bool) -> dict:
    import plotly
    import plotly.graph_objects as go
    results = run_cells(CELLS, model) if run else []
    page = browser = pw = None
    tmp = Path(tempfile.mkdtemp())
    if run and os.path.exists(CHROMIUM):
        from playwright.sync_api import sync_playwright
        (tmp / "plotly.min.js").write_bytes(
            (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes())
        pw = sync_playwright().start()
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu",
                                                                      "--disable-background-networking",
                                                                      "--disable-component-update",
                                                                      "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1100, "height": 800})
    cells, k = [], 0
    for kind, src in CELLS:
        lines = src.splitlines(keepends=True)
        if kind == "markdown":
            cells.append({"cell_type": "markdown", "metadata": {}, "source": lines})
            continue
        outputs = []
        if results:
            stdout, value = results[k]
            if stdout:
                outputs.append({"output_type": "stream", "name": "stdout", "text": stdout.splitlines(keepends=True)})
            data = None
            if isinstance(value, go.Figure):
                data = {"text/plain": ["<plotly Figure>"]}
                if page is not None:
                    data["image/png"] = _png(value, page, tmp)
            elif value is not None and hasattr(value, "to_html"):
                data = {"text/html": value.to_html(index=False).splitlines(keepends=True),
                        "text/plain": str(value).splitlines(keepends=True)}
            elif value is not None:
                data = {"text/plain": repr(value).splitlines(keepends=True)}
            if data:
                outputs.append({"output_type": "execute_result", "execution_count": k + 1, "metadata": {},
                                "data": data})
        cells.append({"cell_type": "code", "execution_count": (k + 1) if results else None, "metadata": {},
                      "outputs": outputs, "source": lines})
        k += 1
    if browser is not None:
        browser.close()
        pw.stop()
    return {"cells": cells, "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                        "name": "python3"},
                                         "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:tiny", help='"dummy:tiny" or "bundled"')
    ap.add_argument("--no-run", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    nb = build(None if a.model == "bundled" else a.model, not a.no_run)
    OUT.write_text(json.dumps(nb, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
