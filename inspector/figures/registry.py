"""The chart registry: `SPECS` (name -> builder of one snapshot), `TITLES`, and `build_specs` / `build_all`,
which build every chart and turn a failing builder into an error chart."""
from __future__ import annotations

import logging
from typing import Callable

from inspector.figures.blocks import block_map_spec
from inspector.figures.latency import latency_spec, throughput_spec
from inspector.figures.layout import as_figure, error_spec
from inspector.figures.memory import memory_spec
from inspector.figures.spec_decode import spec_spec
from inspector.figures.timeline import timeline_spec
from inspector.figures.timings import timings_spec
from inspector.recorder import Snapshot

log = logging.getLogger(__name__)

SPECS: dict[str, Callable[[Snapshot], dict]] = {
    "block_map": lambda snap: block_map_spec(snap.kv),
    "timeline": lambda snap: timeline_spec(snap, axis="time"),
    "timeline_step": lambda snap: timeline_spec(snap, axis="step"),
    "timings": timings_spec,
    "spec": spec_spec,
    "latency": lambda snap: latency_spec(snap.records),
    "throughput": throughput_spec,
    "memory": memory_spec,
}
TITLES = {"block_map": "KV block map", "timeline": "Scheduler timeline", "timeline_step": "Scheduler timeline",
          "timings": "Per-step timings", "spec": "Speculative decoding", "latency": "Latency distributions",
          "throughput": "Throughput and KV usage", "memory": "Memory over time"}


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
