"""Shared helpers for benchmark scripts: device naming and result files."""
from __future__ import annotations

import json
import platform
import re
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


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(" | ".join(c.ljust(widths[c]) for c in cols))
    print("-+-".join("-" * widths[c] for c in cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in cols))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.2f}"
    return "" if v is None else str(v)
