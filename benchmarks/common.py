"""Shared helpers for benchmark scripts: device naming, result files and a free local port."""
from __future__ import annotations

import json
import os
import platform
import sys
import re
import socket
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def device_name(device: str = "auto") -> str:
    if (device == "auto" and torch.cuda.is_available()) or device.startswith("cuda"):
        return torch.cuda.get_device_name()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
    except Exception:
        model = platform.processor() or "cpu"
    return f"{model} ({torch.get_num_threads()} threads)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a benchmark or test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    if os.environ.get("OUT"):                   # a copy where the caller collects results
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], path.name).write_text(path.read_text())
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max([len(c)] + [len(_fmt(r.get(c))) for r in rows]) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return "" if v is None else str(v)


def write_png(fig, png: Path, width: int = 1100, height: int = 640) -> str | None:
    """A Plotly figure as PNG: through kaleido when installed, else Playwright + /usr/bin/chromium; -> which, or None."""
    try:
        fig.write_image(str(png), scale=1, width=width, height=height)         # kaleido, when installed
        return "kaleido"
    except Exception:
        pass
    if not os.path.exists("/usr/bin/chromium"):
        return None
    import tempfile
    try:
        from playwright.sync_api import sync_playwright
        with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
            html = Path(tmp) / "figure.html"               # plotly.js inline: the browser is offline
            fig.write_html(str(html), include_plotlyjs=True)
            b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            page = b.new_page(viewport={"width": width + 20, "height": height + 20})
            page.goto(html.resolve().as_uri())
            page.wait_for_selector(".main-svg", timeout=30000)
            page.locator(".js-plotly-plot").first.screenshot(path=str(png))
            b.close()
        return "chromium"
    except Exception as e:
        print(f"(no PNG: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def load_gemv_table(path: str) -> None:
    """Merge a sweep's winners (benchmarks/sweep_gemv.py --table-out: a JSON {"N,K": config, "qkv:N,K,D":
    config}) into the engine's GEMV_CONFIGS and QKV_ROPE_CONFIGS, to measure them before they are copied in."""
    import json

    from engine.kernels.gemv import GEMV_CONFIGS
    from engine.kernels.qkv_rope import QKV_ROPE_CONFIGS
    with open(path) as f:
        for key, cfg in json.load(f).items():
            dims = tuple(int(v) for v in key.split(":")[-1].split(","))
            (QKV_ROPE_CONFIGS if key.startswith("qkv:") else GEMV_CONFIGS)[dims] = tuple(cfg)
