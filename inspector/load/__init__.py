"""Simulated users: arrival processes, workload presets, and a runner that drives an EngineLoop in-process.

Arrivals follow `vllm bench serve`: inter-arrival times are gamma distributed with shape k = burstiness
and scale 1 / (rate * k), so the mean rate is `rate` for every k; k = 1 is a Poisson process, k < 1 is
burstier, k > 1 more regular. rate = inf sends everything at once.

Prompts are random token ids (seeded, special tokens excluded) so their lengths are exact, or with
`prompt_source="text"` chat prompts from a small bundled text set (at most the sampled lengths); outputs
use greedy decoding with `ignore_eos` by default so their lengths are exact too.

Modules, one concern each:

- `arrivals`  gamma / Poisson arrival offsets (`arrival_times`)
- `spec`      token-length distributions (`LengthDist`), the `LoadSpec` and its limits
- `capacity`  what the engine sustains, measured in seconds (`Capacity`, `measure_capacity`)
- `presets`   `EngineInfo` and the workload presets (`PRESETS`, `preset`), rates sized from `Capacity`
- `text`      templated chat prompts from the bundled text set (`TextPrompts`)
- `workload`  a spec turned into seeded requests (`LoadItem`, `build_workload`)
- `runner`    `LoadRunner`, which drives the engine, and `format_progress`

The public names are re-exported here, so `from inspector import load as L; L.LoadRunner(...)` works.
"""
from __future__ import annotations

from inspector.load.arrivals import arrival_times  # noqa: F401
from inspector.load.capacity import Capacity, measure_capacity  # noqa: F401
from inspector.load.presets import PRESETS, EngineInfo, preset  # noqa: F401
from inspector.load.runner import LoadRunner, format_progress  # noqa: F401
from inspector.load.spec import (LENGTH_KINDS, MAX_CONCURRENCY, MAX_RATE, MAX_REQUESTS, PROMPT_SOURCES,  # noqa: F401
                                 LengthDist, LoadSpec)
from inspector.load.text import TextPrompts, text_set  # noqa: F401
from inspector.load.workload import LoadItem, build_workload  # noqa: F401
