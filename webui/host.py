"""EngineHost: the engine on its thread, its event recorder, the figure producer, the load and compare jobs."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from inspector import figures as F
from inspector import load as L
from inspector import metrics as M
from inspector.recorder import Recorder, Snapshot

log = logging.getLogger("kvscope.app")


class EngineUnavailable(RuntimeError):
    pass


@dataclass
class Published:
    """What the producer publishes once per refresh: read-only for every handler."""
    version: int = 0
    built_at: float = 0.0
    snapshot: Snapshot | None = None
    kv: dict | None = None
    stats: dict = field(default_factory=dict)
    plots: dict[str, str] = field(default_factory=dict)     # name -> Plotly JSON
    hashes: dict[str, int] = field(default_factory=dict)    # name -> hash of that JSON
    build_ms: float = 0.0


def _default_loop_factory(config: EngineConfig):
    if config.parallel_config.data_parallel_size > 1:
        from engine.runtime.dp_loop import DPEngineLoop
        return DPEngineLoop(config)
    from engine.runtime.async_engine import EngineLoop
    return EngineLoop(config)


class EngineHost:
    """The engine, its recorder, the figure producer, the current load and compare job."""

    def __init__(self, config: EngineConfig, refresh_s: float = 1.0, loop_factory=_default_loop_factory):
        self.config = config
        self.refresh_s = refresh_s
        self.loop_factory = loop_factory
        self.loop = None
        self.recorder = Recorder()
        self.state = "stopped"            # starting | ready | restarting | error | stopped
        self.error: str | None = None
        self.published = Published()
        self.load: L.LoadRunner | None = None
        self.compare: CompareJob | None = None
        self.profile_rows: list[dict] | None = None
        self.profile_note: str = ""
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._producer: threading.Thread | None = None
        self._active: dict[str, Any] = {}   # browser tab (Gradio session hash) -> its playground stream
        self.want_step_axis_until = 0.0     # build the step-axis timeline only while someone looks at it
        self._ids = 0
        self.api_options: dict = {}         # register() kwargs for the serving API (api_key, timeouts, ...)
        self.self_url: str | None = None    # this process's base URL once it serves (the HTTP load target)
        self._capacity: tuple[Any, L.Capacity] | None = None    # (loop it was measured on, capacity)
        self._capacity_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def start(self, inspect: bool = True) -> "EngineHost":
        """Load the engine; with `inspect`, record its events and run the figure producer (the UI needs
        both; a pure API server does not, and then the engine skips building events altogether)."""
        self.inspect = inspect
        self._start_engine(self.config)
        if inspect and self._producer is None:
            self._producer = threading.Thread(target=self._produce, name="kvscope-figures", daemon=True)
            self._producer.start()
        return self

    def _start_engine(self, config: EngineConfig) -> None:
        self.state = "starting"
        t = time.perf_counter()
        try:
            loop = self.loop_factory(config)
            loop.start()
        except Exception as e:
            log.error("engine failed to start: %s: %s", type(e).__name__, e,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            self.state, self.error = "error", f"{type(e).__name__}: {e}"
            raise
        self.recorder.detach()
        self.recorder.clear()
        if getattr(self, "inspect", True):
            self.recorder.attach(*(eng.events for eng in loop.engines))
        with self._lock:
            self.loop, self.config, self.state, self.error = loop, config, "ready", None
        log.info("engine ready in %.1f s: %s", time.perf_counter() - t, self.describe())
        self._kick.set()

    def restart(self, config: EngineConfig) -> str:
        """Stop load, shut the engine down, start one with `config`. On failure the old config comes back."""
        with self._lock:
            if self.state in ("starting", "restarting"):
                raise EngineUnavailable("the engine is already restarting")
            self.state = "restarting"
            old_loop, old_config = self.loop, self.config
            self.loop = None
        if self.load is not None and not self.load.done:
            self.load.stop()
        for s in list(self._active.values()):
            try:
                s.cancel()
            except Exception:
                pass
        self.recorder.detach()
        if old_loop is not None:
            try:
                old_loop.shutdown()
            except Exception:
                log.exception("shutdown failed")
        try:
            self._start_engine(config)
            return f"Engine restarted: {self.describe()}"
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            try:
                self._start_engine(old_config)
            except Exception:
                return f"Could not start the new engine ({msg}), and the previous one failed to come back."
            raise EngineUnavailable(f"could not start the engine with these settings: {msg}. "
                                    "The previous settings are back in use.") from e

    def engine_info(self, measure: bool = True) -> L.EngineInfo:
        """The current engine's limits, with its capacity measured once per engine (a few seconds on a CPU;
        presets size their rates from it). Without an engine: the defaults."""
        loop = self.loop
        if loop is None:
            return L.EngineInfo()
        info = L.EngineInfo.from_loop(loop)
        with self._capacity_lock:
            if measure and (self._capacity is None or self._capacity[0] is not loop):
                tok = getattr(loop.engine, "tokenizer", None)
                cap = L.measure_capacity(loop, info.vocab_size, getattr(tok, "all_special_ids", None) or ())
                log.info("engine capacity measured in %.1f s: %s", cap.measured_in_s, cap.describe(160, 80))
                self._capacity = (loop, cap)
            if self._capacity is not None and self._capacity[0] is loop:
                info.capacity = self._capacity[1]
        return info

    def shutdown(self) -> None:
        self._stop.set()
        self._kick.set()
        if self.load is not None:
            self.load.stop()
        if self.compare is not None:
            self.compare.stop()
        if self.loop is not None:
            try:
                self.loop.shutdown()
            except Exception:
                pass

    def require_loop(self):
        loop = self.loop
        if loop is None or self.state != "ready":
            raise EngineUnavailable(f"the engine is {self.state}; try again in a moment"
                                    + (f" ({self.error})" if self.error else ""))
        if getattr(loop, "error", None) is not None and getattr(loop, "_stop", False):
            raise EngineUnavailable(f"the engine stopped: {loop.error}")
        return loop

    def next_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    def describe(self) -> str:
        loop = self.loop
        if loop is None:
            return f"engine {self.state}"
        eng = loop.engine
        dp = loop.config.parallel_config.data_parallel_size
        return (f"{getattr(eng, 'model_name', self.config.model_config.model)} · {getattr(eng, 'device', '?')} · "
                f"{str(getattr(eng, 'dtype', '')).replace('torch.', '')} · "
                f"{getattr(eng, 'weights_description', None) or 'unquantized'} weights · "
                f"{getattr(eng, 'kernels_description', '')} · "
                f"{eng.num_blocks} KV blocks × {eng.block_size} tokens{' per replica' if dp > 1 else ''} · "
                f"max_model_len {getattr(eng, 'max_model_len', '?')} · "
                f"{getattr(eng, 'parallel_layout', 'single device')}"
                + (f" · {dp} data-parallel replicas" if dp > 1 else ""))

    # ------------------------------------------------------------------ figure producer
    def _produce(self) -> None:
        last_v, last_loop, last_t = -1, None, 0.0
        while not self._stop.is_set():
            self._kick.wait(self.refresh_s)
            self._kick.clear()
            try:
                loop = self.loop
                v = self.recorder.version
                if v == last_v and loop is last_loop and time.perf_counter() - last_t < 10.0:
                    continue
                self.publish()
                last_v, last_loop, last_t = v, loop, time.perf_counter()
            except Exception:
                log.exception("figure producer failed (will retry)")

    def publish(self) -> Published:
        """Build every figure once from a fresh snapshot (the producer calls this; tests may too)."""
        t = time.perf_counter()
        loop = self.loop
        kv, stats = None, {}
        if loop is not None:
            try:
                kv = loop.kv_snapshot()
                stats = loop.stats()
            except Exception:
                log.exception("kv_snapshot / stats failed")
        snap = self.recorder.snapshot(kv=kv)
        names = [n for n in F.SPECS if n != "timeline_step" or time.monotonic() < self.want_step_axis_until]
        specs = F.build_specs(snap, names)
        eng = loop.engine if loop is not None else None
        try:
            specs["weights"] = F.weights_spec(getattr(eng, "weight_summary", None), getattr(eng, "quantization", None))
        except Exception as e:
            specs["weights"] = F.error_spec("Model weights", e)
        try:
            specs["parallel"] = F.parallel_spec(eng.parallel_info() if hasattr(eng, "parallel_info") else None)
        except Exception as e:
            specs["parallel"] = F.error_spec("Tensor parallelism", e)
        plots, hashes = {}, {}
        for name, spec in specs.items():
            try:
                js = F.to_json(spec)
            except Exception as e:
                js = F.to_json(F.error_spec(F.TITLES.get(name, name), e))
            plots[name] = js
            hashes[name] = hash(js)
        pub = Published(version=self.published.version + 1, built_at=time.time(), snapshot=snap, kv=kv,
                        stats=stats, plots=plots, hashes=hashes, build_ms=(time.perf_counter() - t) * 1e3)
        self.published = pub
        return pub

    def status_line(self) -> str:
        pub = self.published
        s = pub.stats or {}
        if self.state != "ready":
            return f"**Engine {self.state}**" + (f" — {self.error}" if self.error else "")
        parts = [f"**{self.describe()}**"]
        if s:
            replicas = s.get("replicas") or ()
            step = "" if replicas else f"step {s.get('step', 0)} · "       # each replica counts its own steps
            parts.append(f"{step}running {s.get('num_running', 0)} · waiting "
                         f"{s.get('num_waiting', 0)} · KV {100 * s.get('kv_usage', 0):.0f}% · "
                         f"preemptions {s.get('num_preemptions_total', 0)}")
            for i, r in enumerate(replicas):
                parts.append(f"replica {i}: step {r.get('step', 0)}, running {r.get('num_running', 0)}, "
                             f"waiting {r.get('num_waiting', 0)}, KV {100 * r.get('kv_usage', 0):.0f}%")
        if self.load is not None and not self.load.done:
            parts.append("load running")
        return " · ".join(parts)


class CompareJob:
    """Runs the same seeded workload under two configs, one after the other, each on its own engine."""

    def __init__(self, configs: dict[str, EngineConfig], spec: L.LoadSpec, slo: M.SLO | None,
                 loop_factory=_default_loop_factory):
        self.configs = configs
        self.spec = spec
        self.slo = slo
        self.loop_factory = loop_factory
        self.results: dict[str, dict] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.status = "queued"
        self.error: str | None = None
        self.errors: dict[str, str] = {}        # per config label
        self.current: str | None = None
        self.runner: L.LoadRunner | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-compare", daemon=True)
        self.done = threading.Event()

    def start(self) -> "CompareJob":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.runner is not None:
            self.runner.stop()

    def _run(self) -> None:
        try:
            for label, cfg in self.configs.items():
                if self._stop.is_set():
                    break
                self.current, self.status = label, f"{label}: loading engine"
                try:
                    loop = self.loop_factory(cfg)
                    loop.start()
                except Exception as e:
                    self.errors[label] = f"engine did not start: {type(e).__name__}: {e}"
                    continue
                rec = Recorder().attach(*(eng.events for eng in loop.engines))
                try:
                    self.status = f"{label}: running {self.spec.num_requests} requests"
                    self.runner = L.LoadRunner(loop, dataclasses.replace(self.spec), recorder=rec, slo=self.slo)
                    self.runner.start()
                    while not self.runner.wait(0.2):
                        if self._stop.is_set():
                            self.runner.stop()
                    s = self.runner.summary()
                    snap = rec.snapshot(kv=loop.kv_snapshot())
                    s["engine_preemptions"] = snap.totals.get("preemptions", 0)
                    s["steps"] = snap.totals.get("steps", 0)
                    s["mean_step_ms"] = (1e3 * snap.totals.get("busy_time", 0) / max(1, snap.totals.get("steps", 1)))
                    self.results[label] = s
                    self.snapshots[label] = snap
                except Exception as e:  # e.g. the workload does not fit this config's max_model_len
                    self.errors[label] = f"{type(e).__name__}: {e}"
                finally:
                    rec.detach()
                    loop.shutdown()
            self.status = "stopped" if self._stop.is_set() else "done"
        except Exception as e:
            log.exception("compare failed")
            self.error = f"{type(e).__name__}: {e}"
            self.status = "error"
        finally:
            self.current = None
            self.done.set()


def max_model_len(host: EngineHost) -> int | None:
    loop = host.loop
    return getattr(loop.engine, "max_model_len", None) if loop is not None else None
