"""Plotly figure builders for the inspector: pure functions of a `Snapshot` (and a kv snapshot dict).

Each chart has a `*_spec()` that returns a plain Plotly JSON dict (`{"data": [...], "layout": {...}}`)
and a `*_figure()` that wraps it in a `plotly.graph_objects.Figure` for notebooks. The app serialises the
specs directly (`to_json`): building through plotly's validated object tree costs ~50 ms per subplot
figure on a 2-core CPU, the dict path ~1-5 ms, and the engine shares those cores.

Rules kept everywhere (NOTES, "Gradio and Plotly"): an explicit height, a `uirevision` so zoom and legend
toggles survive live refreshes, numeric axes (the Gantt is a horizontal bar with `base`, never
`px.timeline`), fixed colour ranges for heatmaps, histograms binned here rather than in the browser, and
bounded payloads (latest N requests / steps).

Modules, one concern each:

- `style`        colours and fonts (phase, block-map owner, region palettes)
- `layout`       JSON-safe specs (`to_json`, `as_figure`), the common layout, a manual subplot grid, empty /
                 error charts, and `_fig` (spec builder -> Figure builder)
- `blocks`       KV block map and a request's block table
- `timeline`     scheduler timeline (Gantt + batch composition)
- `timings`      per-step timing regions and one profiled step
- `spec_decode`  speculative-decoding acceptance
- `latency`      latency histograms and throughput / KV usage over time
- `lessons`      one chart per lesson result (inspector.lessons)
- `memory`       allocated / KV reserved / KV used memory over time
- `weights`      model weight bytes per layer and dtype (quantization)
- `parallel`     how a layer's heads and rows are split across tensor-parallel ranks, each rank's memory
- `registry`     `SPECS`, `TITLES`, `build_specs`, `build_all`

The public names are re-exported here, so `from inspector import figures as F; F.timeline_spec(...)` works.
"""
from __future__ import annotations

from inspector.figures.blocks import (block_fill, block_map_figure, block_map_spec, block_states,  # noqa: F401
                                      block_table_figure, block_table_spec)
from inspector.figures.latency import (histogram, latency_figure, latency_spec, throughput_figure,  # noqa: F401
                                       throughput_spec)
from inspector.figures.layout import (as_figure, empty_figure, empty_spec, error_figure, error_spec,  # noqa: F401
                                      to_json)
from inspector.figures.lessons import lesson_figure, lesson_spec  # noqa: F401
from inspector.figures.memory import memory_figure, memory_spec  # noqa: F401
from inspector.figures.parallel import parallel_figure, parallel_spec  # noqa: F401
from inspector.figures.registry import SPECS, TITLES, build_all, build_specs  # noqa: F401
from inspector.figures.spec_decode import spec_figure, spec_spec  # noqa: F401
from inspector.figures.style import (CACHED_COLOR, CATEGORY_COLORS, FONT, FREE_COLOR, GRID, N_CATS,  # noqa: F401
                                     OWNER_PALETTE, PHASE_COLORS, REGION_COLORS, SHARED_COLOR, owner_color)
from inspector.figures.timeline import timeline_figure, timeline_spec  # noqa: F401
from inspector.figures.timings import (REGION_ORDER, SUBREGIONS, profile_figure, profile_spec,  # noqa: F401
                                       step_regions, timings_figure, timings_spec)
from inspector.figures.weights import weights_figure, weights_spec  # noqa: F401
