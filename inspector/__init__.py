"""kvscope inspector: turns the engine's event stream into metrics, figures and load.

Nothing in this package imports Gradio: every piece works from a plain Python process or a notebook.

- `recorder.Recorder`   subscribes to `engine.events.EventBus`, keeps bounded ring buffers, and hands out
                        consistent `Snapshot`s (per-request spans, steps, finished-request records).
- `metrics`             TTFT / TPOT / ITL / E2EL, throughput and goodput from `RequestMetrics` stamps.
- `figures`             Plotly figure builders (block map, timeline, step timings, spec decoding, latency),
                        one module per chart family; public names re-exported from `inspector.figures`.
- `load`                gamma arrivals, length specs, workload presets and simulated users driving an
                        `EngineLoop`, one module each; public names re-exported from `inspector.load`.
- `lessons`             seeded experiments (paged vs contiguous, cache on/off, continuous vs static, batch
                        sweep, chunked prefill) that return plain JSON results; charts in `figures.lessons`.
- `export`              metrics CSV and Chrome-trace JSON (opens in Perfetto).
"""
from inspector.recorder import Recorder, RequestRecord, Snapshot  # noqa: F401
