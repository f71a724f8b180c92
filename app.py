"""kvscope app: a Gradio playground and live inspector over the engine, in one process.

    python app.py [--host 127.0.0.1] [--port 7860] [--model PATH|dummy:NAME] [--device auto|cpu|cuda]
                  [--set FIELD=VALUE ...] [--api-only] [--api-key KEY] [--request-timeout S]

Structure (one-way flow):
  EngineHost   owns the EngineLoop (engine on its own thread), the inspector Recorder subscribed to its
               events, the current load run and compare job, and ONE producer thread that turns the
               latest snapshot into serialised Plotly figures about twice a second.
  build_ui     Gradio Blocks; timer handlers only read the producer's latest snapshot (cheap, no
               per-tab queueing, concurrency_limit=None); request handlers call the engine's public API.
  create_app   a FastAPI app with the Gradio UI mounted at "/"; the serving API (another module)
               registers its routes on the same app first (`--api-only` serves just those).
"""
from __future__ import annotations

import argparse
import dataclasses
import html
import logging
import math
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gradio as gr  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.sampling_params import MAX_LOGPROBS, SamplingParams  # noqa: E402
from inspector import export as X  # noqa: E402
from inspector import figures as F  # noqa: E402
from inspector import load as L  # noqa: E402
from inspector import metrics as M  # noqa: E402
from inspector.profile import can_profile, profile_one_step  # noqa: E402
from inspector.recorder import Recorder, Snapshot  # noqa: E402

log = logging.getLogger("kvscope.app")
ROOT = Path(__file__).resolve().parent
MAX_PROMPT_CHARS = 200_000
PLAYGROUND_MAX_TOKENS = 8192


class EngineUnavailable(RuntimeError):
    pass


# =============================================================================== engine host
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
    from engine.async_engine import EngineLoop
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
        self._active: dict[str, Any] = {}   # session -> playground stream
        self.want_step_axis_until = 0.0     # build the step-axis timeline only while someone looks at it
        self._ids = 0
        self.api_options: dict = {}         # register() kwargs for the serving API (api_key, timeouts, ...)
        self.self_url: str | None = None    # this process's base URL once it serves (the HTTP load target)

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
            log.exception("engine failed to start")
            self.state, self.error = "error", f"{type(e).__name__}: {e}"
            raise
        self.recorder.detach()
        self.recorder.clear()
        if getattr(self, "inspect", True):
            self.recorder.attach(loop.engine.events)
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
        return (f"{getattr(eng, 'model_name', self.config.model)} · {getattr(eng, 'device', '?')} · "
                f"{str(getattr(eng, 'dtype', '')).replace('torch.', '')} · {getattr(eng, 'kernels', '')} kernels · "
                f"{eng.num_blocks} KV blocks × {eng.block_size} tokens · max_model_len "
                f"{getattr(eng, 'max_model_len', '?')}")

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
            parts.append(f"step {s.get('step', 0)} · running {s.get('num_running', 0)} · waiting "
                         f"{s.get('num_waiting', 0)} · KV {100 * s.get('kv_usage', 0):.0f}% · "
                         f"preemptions {s.get('num_preemptions_total', 0)}")
        if self.load is not None and not self.load.done:
            parts.append("load running")
        return " · ".join(parts)


# =============================================================================== compare
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
                rec = Recorder().attach(loop.engine.events)
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


# =============================================================================== input parsing
def _num(v, name: str, *, integer: bool = False, lo: float | None = None, hi: float | None = None,
         allow_none: bool = False, lo_exclusive: bool = False):
    """Parse a UI number with a clear message naming the field."""
    if v is None or (isinstance(v, str) and not v.strip()) or (isinstance(v, float) and math.isnan(v)):
        if allow_none:
            return None
        raise ValueError(f"{name}: required")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: must be a number (got {v!r})") from None
    if math.isnan(x) or math.isinf(x):
        raise ValueError(f"{name}: must be a finite number (got {v!r})")
    if integer:
        if x != int(x):
            raise ValueError(f"{name}: must be a whole number (got {v!r})")
        x = int(x)
    if lo is not None and (x <= lo if lo_exclusive else x < lo):
        raise ValueError(f"{name}: must be {'>' if lo_exclusive else '>='} {lo:g} (got {v!r})")
    if hi is not None and x > hi:
        raise ValueError(f"{name}: must be <= {hi:g} (got {v!r})")
    return x


def make_sampling_params(temperature, top_p, top_k, min_p, max_tokens, min_tokens, repetition_penalty,
                         presence_penalty, frequency_penalty, seed, stop, ignore_eos, logprobs_on, logprobs_n,
                         max_model_len: int | None = None) -> SamplingParams:
    cap = min(PLAYGROUND_MAX_TOKENS, max_model_len or PLAYGROUND_MAX_TOKENS)
    mt = _num(max_tokens, "max tokens", integer=True, lo=1)
    if mt > cap:
        raise ValueError(f"max tokens: {mt} is too many; at most {cap} here (the engine's max_model_len is "
                         f"{max_model_len})")
    stops = [s for s in (stop or "").replace("\\n", "\n").split("\n") if s] if isinstance(stop, str) else list(stop or [])
    try:
        return SamplingParams(
            temperature=_num(temperature, "temperature", lo=0, hi=10), top_p=_num(top_p, "top-p", lo=0, hi=1, lo_exclusive=True),
            top_k=_num(top_k, "top-k", integer=True, lo=-1), min_p=_num(min_p, "min-p", lo=0, hi=1),
            max_tokens=mt, min_tokens=_num(min_tokens, "min tokens", integer=True, lo=0, hi=mt),
            repetition_penalty=_num(repetition_penalty, "repetition penalty", lo=0, lo_exclusive=True, hi=10),
            presence_penalty=_num(presence_penalty, "presence penalty", lo=-2, hi=2),
            frequency_penalty=_num(frequency_penalty, "frequency penalty", lo=-2, hi=2),
            seed=_num(seed, "seed", integer=True, lo=0, allow_none=True), stop=stops or None,
            ignore_eos=bool(ignore_eos),
            logprobs=(_num(logprobs_n, "logprobs top-n", integer=True, lo=0, hi=MAX_LOGPROBS) if logprobs_on else None))
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg.replace("SamplingParams.", "")) from None


def make_load_spec(preset_name, num_requests, rate, all_at_once, burstiness, max_concurrency,
                   p_kind, p_min, p_max, o_kind, o_min, o_max, shared_prefix, turns, think_time, seed,
                   temperature, ignore_eos, max_model_len: int | None = None) -> L.LoadSpec:
    n = _num(num_requests, "number of requests", integer=True, lo=1)
    if n > L.MAX_REQUESTS:
        raise ValueError(f"number of requests: too many simulated users ({n}); at most {L.MAX_REQUESTS}")
    if all_at_once:
        r = math.inf
    else:
        r = _num(rate, "rate (requests/s)", allow_none=True)
        if r is None or r <= 0:
            raise ValueError(f"rate: must be > 0 requests/s (got {rate!r}); tick 'all at once' for a burst")
    conc = _num(max_concurrency, "max concurrency", integer=True, lo=0, allow_none=True)
    spec = L.LoadSpec(
        name=str(preset_name or "custom"), num_requests=n, rate=r,
        burstiness=_num(burstiness, "burstiness", lo=0, lo_exclusive=True, hi=100),
        max_concurrency=(conc or None),
        prompt_len=L.LengthDist(str(p_kind), _num(p_min, "prompt min tokens", integer=True, lo=1),
                                _num(p_max, "prompt max tokens", integer=True, lo=1)),
        output_len=L.LengthDist(str(o_kind), _num(o_min, "output min tokens", integer=True, lo=1),
                                _num(o_max, "output max tokens", integer=True, lo=1)),
        seed=_num(seed, "seed", integer=True, lo=0),
        shared_prefix_len=_num(shared_prefix, "shared prefix tokens", integer=True, lo=0, allow_none=True) or 0,
        num_turns=_num(turns, "turns per user", integer=True, lo=1, hi=64, allow_none=True) or 1,
        think_time_s=_num(think_time, "think time (s)", lo=0, hi=600, allow_none=True) or 0.0,
        temperature=_num(temperature, "temperature", lo=0, hi=10, allow_none=True) or 0.0,
        ignore_eos=bool(ignore_eos))
    spec.validate(max_model_len)
    return spec


def make_http_runner(host: "EngineHost", spec: L.LoadSpec, slo: M.SLO | None, url, model, key):
    """The load generator's HTTP target: `url` empty = this process's own OpenAI-compatible API."""
    from inspector.http_load import HttpLoadRunner, HttpTarget
    url = str(url or "").strip()
    self_target = not url
    if self_target:
        if not host.self_url:
            raise ValueError("HTTP base URL: this app is not serving the HTTP API here; enter a server's URL")
        url = host.self_url
    key = str(key or "").strip() or (host.api_options.get("api_key") if self_target else None)
    try:
        target = HttpTarget(url, model=str(model or "").strip() or None, api_key=key)
        # records of this server's own requests come from the engine's events; a remote server's only
        # from the wire, so those feed the inspector's latency panel
        return HttpLoadRunner(target, spec, slo=slo, on_record=None if self_target else host.recorder.record_output)
    except ValueError:
        raise
    except Exception as e:   # connection refused, DNS, timeouts: a clear message, never a crash
        raise ValueError(f"HTTP base URL: could not reach {url}: {type(e).__name__}: {e}") from None


def make_slo(ttft, tpot, e2el) -> M.SLO:
    return M.SLO(ttft_ms=_num(ttft, "TTFT SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None,
                 tpot_ms=_num(tpot, "TPOT SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None,
                 e2el_ms=_num(e2el, "E2EL SLO (ms)", lo=0, lo_exclusive=True, allow_none=True) or None)


# engine settings form: every EngineConfig field, typed
_CHOICES = {"device": ["auto", "cpu", "cuda"], "dtype": ["auto", "float32", "float16", "bfloat16"],
            "scheduling": ["continuous", "static"], "kernels": ["auto", "torch", "triton"],
            "speculative_method": ["off", "ngram", "draft", "self"]}
_OPTIONAL_INT = {"num_kv_blocks", "max_model_len", "max_waiting_requests"}
_OPTIONAL_STR = {"model", "draft_model"}
_HELP = {
    "model": "HF folder, dummy:<preset> (random weights), or empty for the bundled SmolLM2-135M-Instruct",
    "num_kv_blocks": "0 or empty: derived from the memory budget", "max_model_len": "0 or empty: the model's (≤ 8192)",
    "max_waiting_requests": "0 or empty: unbounded queue", "enable_kv_cache": "off = recompute the prefix every step",
    "scheduling": "static: a batch runs until all its requests finish",
    "gpu_memory_utilization": "fraction of free GPU memory for weights + KV",
    "cpu_kv_cache_gib": "KV pool size on CPU", "enable_step_timings": "per-region timings in step events",
}


def config_field_specs() -> list[tuple[str, str, Any]]:
    """(name, kind, default) for every EngineConfig field; kind in bool/choice/int/opt_int/float/str/opt_str."""
    out = []
    for f in dataclasses.fields(EngineConfig):
        d = f.default if f.default is not dataclasses.MISSING else None
        ann = str(f.type).replace(" ", "")          # e.g. "int|None" (fields added later are typed too)
        if f.name in _CHOICES:
            kind = "choice"
        elif f.name in _OPTIONAL_INT or (d is None and ann.startswith("int")):
            kind = "opt_int"
        elif f.name in _OPTIONAL_STR or (d is None and ann.startswith("str")):
            kind = "opt_str"
        elif d is None and ann.startswith("float"):
            kind = "opt_float"
        elif isinstance(d, bool):
            kind = "bool"
        elif isinstance(d, int):
            kind = "int"
        elif isinstance(d, float):
            kind = "float"
        else:
            kind = "str"
        out.append((f.name, kind, d))
    return out


def config_from_form(names: list[str], values: list) -> EngineConfig:
    kinds = {n: k for n, k, _ in config_field_specs()}
    kw = {}
    for name, v in zip(names, values):
        kind = kinds[name]
        if kind == "bool":
            kw[name] = bool(v)
        elif kind == "choice":
            kw[name] = None if (name == "speculative_method" and v in ("off", "", None)) else str(v)
        elif kind == "opt_int":
            x = _num(v, name, integer=True, allow_none=True)
            kw[name] = None if x in (None, 0) else x
        elif kind == "opt_float":
            kw[name] = _num(v, name, allow_none=True)
        elif kind == "int":
            kw[name] = _num(v, name, integer=True)
        elif kind == "float":
            kw[name] = _num(v, name)
        elif kind == "opt_str":
            kw[name] = (str(v).strip() or None) if v is not None else None
        else:
            kw[name] = str(v)
    return EngineConfig(**kw)


def config_form_values(cfg: EngineConfig, names: list[str]) -> list:
    out = []
    d = cfg.to_dict()
    kinds = {n: k for n, k, _ in config_field_specs()}
    for n in names:
        v = d[n]
        if n == "speculative_method":
            v = v or "off"
        elif kinds.get(n) == "opt_str":
            v = v or ""
        out.append(v)
    return out


# =============================================================================== formatting
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


CSS = """
.kv-progress {font-size: 14px; padding: 4px 0;}
.kv-bar {height: 10px; background: #eef0f3; border-radius: 5px; overflow: hidden; margin-bottom: 6px;}
.kv-bar > div {height: 100%; background: #4E79A7; transition: width .4s;}
.kv-progress[data-state=done] .kv-bar > div {background: #59A14F;}
.kv-progress[data-state=stopped] .kv-bar > div {background: #E15759;}
.kv-err {color: #b00020; font-size: 12px; margin-top: 4px;}
#kv-status {font-size: 13px;}
footer {display: none !important;}
"""


# =============================================================================== UI
def build_ui(host: EngineHost):
    from gradio.components.plot import PlotData

    def plot(js: str):
        return PlotData(type="plotly", plot=js)

    def spec_plot(spec: dict):
        return plot(F.to_json(spec))

    def max_len() -> int | None:
        loop = host.loop
        return getattr(loop.engine, "max_model_len", None) if loop is not None else None

    with gr.Blocks(title="kvscope — an LLM engine you can see into") as demo:
        gr.Markdown("## kvscope · an LLM inference engine you can see into\n"
                    "Paged KV cache, continuous batching, chunked prefill, preemption and prefix caching — "
                    "send prompts, launch simulated users, and watch the engine's blocks and steps live in "
                    "the **Inspector**.")
        status = gr.Markdown(host.status_line(), elem_id="kv-status")
        status_timer = gr.Timer(2.0)
        status_timer.tick(lambda: host.status_line(), None, status, concurrency_limit=None, show_progress="hidden",
                          queue=False, api_visibility="private")

        # ------------------------------------------------------------------ Playground
        with gr.Tab("Playground", id="playground"):
            with gr.Row():
                with gr.Column(scale=3):
                    mode = gr.Radio(["Chat", "Completion"], value="Chat", label="Mode",
                                    info="Chat applies the model's chat template; Completion sends raw text.")
                    with gr.Group(visible=True) as chat_group:
                        chatbot = gr.Chatbot(label="Chat", height=380, elem_id="kv-chatbot")
                        system = gr.Textbox(label="System prompt (optional)", lines=1, placeholder="You are a helpful assistant.")
                        chat_in = gr.Textbox(label="Message", placeholder="Ask something…", lines=2, elem_id="kv-chat-input")
                    with gr.Group(visible=False) as comp_group:
                        comp_in = gr.Textbox(label="Prompt (raw text)", lines=5, elem_id="kv-comp-input",
                                             placeholder="Once upon a time")
                        comp_out = gr.Textbox(label="Completion", lines=8, interactive=False, elem_id="kv-comp-output")
                    with gr.Row():
                        send = gr.Button("Send", variant="primary", elem_id="kv-send")
                        stop = gr.Button("Stop", variant="stop", elem_id="kv-stop")
                        clear = gr.Button("Clear")
                    req_stats = gr.Markdown(elem_id="kv-req-stats")
                    lp_table = gr.Dataframe(headers=["#", "token", "logprob", "prob", "top alternatives"],
                                            label="Per-token logprobs (enable in Sampling)", visible=True,
                                            interactive=False, max_height=300, wrap=True)
                with gr.Column(scale=2):
                    with gr.Accordion("Sampling", open=True):
                        temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="temperature (0 = greedy)",
                                                elem_id="kv-temperature")
                        top_p = gr.Slider(0.01, 1, value=0.95, step=0.01, label="top-p")
                        top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
                        min_p = gr.Slider(0, 1, value=0.0, step=0.01, label="min-p")
                        max_tokens = gr.Number(value=128, precision=0, label="max tokens")
                        min_tokens = gr.Number(value=0, precision=0, label="min tokens")
                        rep_pen = gr.Slider(0.5, 2, value=1.0, step=0.01, label="repetition penalty")
                        pres_pen = gr.Slider(-2, 2, value=0.0, step=0.05, label="presence penalty")
                        freq_pen = gr.Slider(-2, 2, value=0.0, step=0.05, label="frequency penalty")
                        seed = gr.Textbox(value="", label="seed (empty = random)", placeholder="random", max_lines=1,
                                          elem_id="kv-seed")   # a gr.Number would show and send 0
                        stop_str = gr.Textbox(label="stop strings (one per line)", lines=2)
                        ignore_eos = gr.Checkbox(value=False, label="ignore EOS")
                        with gr.Row():
                            lp_on = gr.Checkbox(value=False, label="logprobs")
                            lp_n = gr.Slider(0, MAX_LOGPROBS, value=3, step=1, label="top-n alternatives")
            sampling = [temperature, top_p, top_k, min_p, max_tokens, min_tokens, rep_pen, pres_pen, freq_pen,
                        seed, stop_str, ignore_eos, lp_on, lp_n]

            def _session(request: gr.Request | None) -> str:
                return getattr(request, "session_hash", None) or "api"

            def _run_stream(prompt, params, session: str, rid: str):
                loop = host.require_loop()
                stream = loop.submit(prompt, params, request_id=rid)
                host._active[session] = stream
                out = None
                try:
                    for out in stream:
                        yield out
                finally:
                    host._active.pop(session, None)
                    if out is None or not out.finished:
                        try:
                            stream.cancel()
                        except Exception:
                            pass
                    elif out is not None:
                        host.recorder.record_output(out)

            def _text(content) -> str:
                if isinstance(content, str):
                    return content
                if isinstance(content, dict):
                    return str(content.get("text") or content.get("content") or "")
                if isinstance(content, (list, tuple)):
                    return "".join(_text(c) for c in content)
                return str(content or "")

            def chat_fn(message, history, system_prompt, *samp, request: gr.Request = None):
                history = list(history or [])
                try:
                    if not message or not str(message).strip():
                        raise ValueError("message: please type a message first")
                    if len(message) > MAX_PROMPT_CHARS:
                        raise ValueError(f"message: too long ({len(message)} characters; at most {MAX_PROMPT_CHARS})")
                    params = make_sampling_params(*samp, max_model_len=max_len())
                    loop = host.require_loop()
                    msgs = [{"role": "system", "content": system_prompt}] if (system_prompt or "").strip() else []
                    msgs += [{"role": m["role"], "content": _text(m["content"])} for m in history
                             if m.get("role") in ("user", "assistant")]
                    msgs.append({"role": "user", "content": message})
                    prompt = loop.engine.apply_chat_template(msgs)
                except (ValueError, EngineUnavailable) as e:
                    raise gr.Error(str(e), duration=8)
                rid = host.next_id("chat")
                history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
                yield history, "", "", []
                try:
                    for out in _run_stream(prompt, params, _session(request), rid):
                        history[-1] = {"role": "assistant", "content": out.text}
                        yield history, "", request_stats_md(out, rid), logprobs_rows(out) if out.finished else gr.skip()
                except ValueError as e:
                    raise gr.Error(str(e), duration=8)
                except Exception as e:  # an error in one request never takes the app down
                    log.exception("chat request failed")
                    raise gr.Error(f"request failed: {type(e).__name__}: {e}", duration=8)

            def complete_fn(prompt, *samp, request: gr.Request = None):
                try:
                    if not prompt or not str(prompt).strip():
                        raise ValueError("prompt: please enter a prompt first")
                    if len(prompt) > MAX_PROMPT_CHARS:
                        raise ValueError(f"prompt: too long ({len(prompt)} characters; at most {MAX_PROMPT_CHARS})")
                    params = make_sampling_params(*samp, max_model_len=max_len())
                except (ValueError, EngineUnavailable) as e:
                    raise gr.Error(str(e), duration=8)
                rid = host.next_id("completion")
                yield "", "", []
                try:
                    for out in _run_stream(prompt, params, _session(request), rid):
                        yield out.text, request_stats_md(out, rid), logprobs_rows(out) if out.finished else gr.skip()
                except (ValueError, EngineUnavailable) as e:
                    raise gr.Error(str(e), duration=8)
                except Exception as e:
                    log.exception("completion request failed")
                    raise gr.Error(f"request failed: {type(e).__name__}: {e}", duration=8)

            def stop_fn(request: gr.Request = None):
                s = host._active.get(_session(request))
                if s is None:
                    return gr.skip()
                s.cancel()
                return gr.skip()

            def send_fn(m, message, history, system_prompt, comp_prompt, *samp, request: gr.Request = None):
                """The Send button serves whichever mode is shown."""
                if m == "Completion":
                    for text, stats, lps in complete_fn(comp_prompt, *samp, request=request):
                        yield gr.skip(), gr.skip(), text, stats, lps
                else:
                    for hist, box, stats, lps in chat_fn(message, history, system_prompt, *samp, request=request):
                        yield hist, box, gr.skip(), stats, lps

            mode.change(lambda m: (gr.update(visible=m == "Chat"), gr.update(visible=m == "Completion")),
                        mode, [chat_group, comp_group], api_visibility="private", queue=False)
            send_outs = [chatbot, chat_in, comp_out, req_stats, lp_table]
            send_ins = [mode, chat_in, chatbot, system, comp_in, *sampling]
            send.click(send_fn, send_ins, send_outs, concurrency_limit=None, api_visibility="private",
                       show_progress="minimal")
            chat_in.submit(send_fn, send_ins, send_outs, concurrency_limit=None, api_visibility="private",
                           show_progress="minimal")
            stop.click(stop_fn, None, None, concurrency_limit=None, api_name="stop", queue=False)
            clear.click(lambda: ([], "", "", [], ""), None, [chatbot, chat_in, req_stats, lp_table, comp_out],
                        api_visibility="private", queue=False)

            # API endpoints (gradio_client): streaming completion and chat with every sampling control
            def complete(prompt: str, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                         min_p: float = 0.0, max_tokens: int = 64, min_tokens: int = 0,
                         repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                         frequency_penalty: float = 0.0, seed: int | None = None, stop: str = "",
                         ignore_eos: bool = False, logprobs: int | None = None,
                         request: gr.Request = None) -> dict:
                """Stream a raw-text completion: yields {text, finished, finish_reason, request_id, stats}."""
                for text, stats, lps in complete_fn(prompt, temperature, top_p, top_k, min_p, max_tokens, min_tokens,
                                                    repetition_penalty, presence_penalty, frequency_penalty, seed,
                                                    stop, ignore_eos, logprobs is not None, logprobs or 0,
                                                    request=request):
                    yield {"text": text, "stats": stats, "logprobs": lps if isinstance(lps, list) else None}

            gr.api(complete, api_name="complete", concurrency_limit=None)

            def chat(message: str, system_prompt: str = "", temperature: float = 0.0, max_tokens: int = 64,
                     seed: int | None = None, request: gr.Request = None) -> dict:
                """Stream a one-turn chat reply through the model's chat template."""
                for hist, _, stats, _ in chat_fn(message, [], system_prompt, temperature, 1.0, 0, 0.0, max_tokens, 0,
                                                 1.0, 0.0, 0.0, seed, "", False, False, 0, request=request):
                    yield {"text": _text(hist[-1]["content"]) if hist else "", "stats": stats}

            gr.api(chat, api_name="chat", concurrency_limit=None)

        # ------------------------------------------------------------------ Load
        with gr.Tab("Load", id="load"):
            gr.Markdown("Simulated users drive the engine in-process through the same `submit()` API the playground "
                        "uses, or — target **HTTP** — send the same workload as streaming `/v1/completions` to this "
                        "server's OpenAI-compatible API or any other (e.g. vLLM), timing TTFT/ITL over the wire. Arrivals are gamma distributed (shape = burstiness, scale = 1 / (rate · burstiness); "
                        "1 = Poisson) as in `vllm bench serve`. Prompts are random token ids of the chosen lengths; "
                        "outputs are greedy with EOS ignored, so lengths are exact.")
            info0 = L.EngineInfo()
            spec0 = L.preset("Steady Poisson", info0)
            with gr.Row():
                preset_dd = gr.Dropdown(list(L.PRESETS), value="Steady Poisson", label="Preset", scale=2,
                                        elem_id="kv-preset")
                preset_md = gr.Markdown(spec0.description)
            with gr.Row():
                n_req = gr.Number(value=spec0.num_requests, precision=0, label="number of requests", elem_id="kv-nreq")
                rate = gr.Number(value=spec0.rate, label="rate (requests/s)", elem_id="kv-rate")
                burst_all = gr.Checkbox(value=False, label="all at once (rate = ∞)")
                burstiness = gr.Number(value=1.0, label="burstiness (gamma shape; 1 = Poisson)")
                conc = gr.Number(value=0, precision=0, label="max concurrency (0 = unlimited)")
            with gr.Row():
                p_kind = gr.Dropdown(list(L.LENGTH_KINDS), value="uniform", label="prompt length distribution")
                p_min = gr.Number(value=spec0.prompt_len.low, precision=0, label="prompt min tokens", elem_id="kv-pmin")
                p_max = gr.Number(value=spec0.prompt_len.high, precision=0, label="prompt max tokens", elem_id="kv-pmax")
                o_kind = gr.Dropdown(list(L.LENGTH_KINDS), value="uniform", label="output length distribution")
                o_min = gr.Number(value=spec0.output_len.low, precision=0, label="output min tokens", elem_id="kv-omin")
                o_max = gr.Number(value=spec0.output_len.high, precision=0, label="output max tokens", elem_id="kv-omax")
            with gr.Accordion("More knobs and SLOs", open=False):
                with gr.Row():
                    shared = gr.Number(value=0, precision=0, label="shared system-prompt tokens")
                    turns = gr.Number(value=1, precision=0, label="turns per user (multi-turn)")
                    think = gr.Number(value=0.0, label="think time between turns (s)")
                    load_seed = gr.Number(value=0, precision=0, label="seed")
                    load_temp = gr.Number(value=0.0, label="temperature")
                    load_ieos = gr.Checkbox(value=True, label="ignore EOS (exact output lengths)")
                with gr.Row():
                    slo_ttft = gr.Number(value=None, label="TTFT SLO (ms, empty = none)", placeholder="none")
                    slo_tpot = gr.Number(value=None, label="TPOT SLO (ms)", placeholder="none")
                    slo_e2el = gr.Number(value=None, label="E2EL SLO (ms)", placeholder="none")
                    fresh = gr.Checkbox(value=True, label="clear the inspector's history at start")
            with gr.Row():
                target = gr.Radio(["in-process engine", "HTTP (OpenAI-compatible)"], value="in-process engine",
                                  label="target", scale=2, elem_id="kv-target",
                                  info="HTTP sends streaming /v1/completions with token-id prompts")
                t_url = gr.Textbox(value="", label="HTTP base URL (empty = this server)", scale=2,
                                   placeholder="http://127.0.0.1:8000/v1", elem_id="kv-target-url")
                t_model = gr.Textbox(value="", label="model (empty = the server's first)", scale=1)
                t_key = gr.Textbox(value="", label="API key (optional)", type="password", scale=1)
            with gr.Row():
                start_btn = gr.Button("Start load", variant="primary", elem_id="kv-start-load")
                stop_btn = gr.Button("Stop load", variant="stop", elem_id="kv-stop-load")
            load_msg = gr.Markdown(elem_id="kv-load-msg")
            prog = gr.HTML(progress_html(None), elem_id="kv-progress")
            summ_md = gr.Markdown(elem_id="kv-summary-md")
            summ = gr.Dataframe(headers=["Metric", "Mean", "P50", "P90", "P99", "N", "Definition"],
                                label="Summary (latencies in ms; computed from the engine's RequestMetrics stamps)",
                                interactive=False, wrap=True, elem_id="kv-summary",
                                column_widths=["17%", "9%", "8%", "8%", "8%", "9%", "41%"])
            load_knobs = [n_req, rate, burst_all, burstiness, conc, p_kind, p_min, p_max, o_kind, o_min, o_max,
                          shared, turns, think, load_seed, load_temp, load_ieos]

            def preset_fn(name):
                loop = host.loop
                try:
                    info = L.EngineInfo.from_loop(loop) if loop is not None else L.EngineInfo()
                    s = L.preset(name, info)
                except Exception as e:
                    raise gr.Error(str(e))
                inf = math.isinf(s.rate)
                return (s.description, s.num_requests, (s.rate if not inf else 8.0), inf, s.burstiness, s.max_concurrency or 0,
                        s.prompt_len.kind, s.prompt_len.low, s.prompt_len.high, s.output_len.kind, s.output_len.low,
                        s.output_len.high, s.shared_prefix_len, s.num_turns, s.think_time_s, s.seed, s.temperature,
                        s.ignore_eos)

            preset_dd.change(preset_fn, preset_dd, [preset_md, *load_knobs], api_name="preset", queue=False)

            def start_fn(name, *args):
                knobs = args[:len(load_knobs)]
                t1, t2, t3, fr, *tgt = args[len(load_knobs):]
                tgt_kind, url, model, key = (list(tgt) + ["in-process engine", "", "", ""][len(tgt):])[:4]
                http = str(tgt_kind or "").startswith("HTTP")
                try:
                    loop = host.require_loop()
                    if host.load is not None and not host.load.done:
                        raise ValueError("a load is already running; stop it first")
                    if host.compare is not None and not host.compare.done.is_set():
                        raise ValueError("a comparison is running; wait for it or stop it")
                    spec = make_load_spec(name, *knobs, max_model_len=None if http else max_len())
                    slo = make_slo(t1, t2, t3)
                    if http:
                        runner = make_http_runner(host, spec, slo, url, model, key)
                    else:
                        runner = L.LoadRunner(loop, spec, recorder=host.recorder, slo=slo)
                    if fr:
                        host.recorder.clear()
                except (ValueError, EngineUnavailable) as e:
                    return f"⚠️ {e}", gr.skip(), gr.skip(), gr.skip()
                host.load = runner.start()
                where = f" → HTTP {runner.target.v1} (model {runner.model})" if http else ""
                return (f"Started **{spec.name}**{where}: {spec.num_requests} requests, "
                        f"{'all at once' if math.isinf(spec.rate) else f'{spec.rate:g} req/s'}, burstiness "
                        f"{spec.burstiness:g}, seed {spec.seed}.", progress_html(runner.progress()), "", None)

            start_btn.click(start_fn, [preset_dd, *load_knobs, slo_ttft, slo_tpot, slo_e2el, fresh, target, t_url,
                                       t_model, t_key],
                            [load_msg, prog, summ_md, summ], api_name="start_load", concurrency_limit=4)

            def stop_load_fn():
                if host.load is None or host.load.done:
                    return "No load is running."
                host.load.stop()
                return "Stopping: in-flight requests are cancelled and their blocks freed."

            stop_btn.click(stop_load_fn, None, load_msg, api_name="stop_load", queue=False)

            def load_status_fn(shown_run):
                r = host.load
                if r is None:
                    return gr.skip(), gr.skip(), gr.skip(), shown_run
                p = r.progress()
                if p["done"] and shown_run == r.run_id:
                    return gr.skip(), gr.skip(), gr.skip(), shown_run
                if p["done"]:
                    s = r.summary()
                    return progress_html(p), summary_md(s), M.summary_table(s), r.run_id
                return progress_html(p), gr.skip(), gr.skip(), shown_run

            shown = gr.State(None)
            load_timer = gr.Timer(0.5)
            load_timer.tick(load_status_fn, shown, [prog, summ_md, summ, shown], concurrency_limit=None,
                            show_progress="hidden", api_visibility="private")

            def load_report() -> dict:
                """For API clients: progress and (when done) the summary dict."""
                r = host.load
                if r is None:
                    return {"progress": None, "summary": None}
                p = r.progress()
                return {"progress": p, "summary": r.summary() if p["done"] else None}

            gr.api(load_report, api_name="load_report", concurrency_limit=None)

        # ------------------------------------------------------------------ Inspector
        with gr.Tab("Inspector", id="inspector"):
            with gr.Row():
                live = gr.Checkbox(value=True, label="live (refresh ~1 s)", scale=1)
                axis = gr.Radio(["time", "step"], value="time", label="timeline axis", scale=1)
                req_dd = gr.Dropdown([], value=None, label="request (block table + highlight)", allow_custom_value=True,
                                     scale=2, elem_id="kv-req-dd")
                insp_info = gr.Markdown(elem_id="kv-insp-info")
            with gr.Row():
                with gr.Column(scale=3):
                    p_block = gr.Plot(label="KV block map", show_label=False, elem_id="kv-plot-blockmap")
                with gr.Column(scale=2):
                    p_table = gr.Plot(label="Block table", show_label=False, elem_id="kv-plot-blocktable")
            p_timeline = gr.Plot(label="Scheduler timeline", show_label=False, elem_id="kv-plot-timeline")
            p_tp = gr.Plot(label="Throughput", show_label=False, elem_id="kv-plot-throughput")
            p_lat = gr.Plot(label="Latency", show_label=False, elem_id="kv-plot-latency")
            p_timings = gr.Plot(label="Step timings", show_label=False, elem_id="kv-plot-timings")
            with gr.Row():
                prof_btn = gr.Button("Profile one step (torch.profiler)", elem_id="kv-profile")
                prof_msg = gr.Markdown()
            p_prof = gr.Plot(label="Profile", show_label=False, visible=False, elem_id="kv-plot-profile")
            p_spec = gr.Plot(label="Speculative decoding", show_label=False, elem_id="kv-plot-spec")
            sent = gr.State({})
            outs = [p_block, p_table, p_timeline, p_tp, p_lat, p_timings, p_spec, req_dd, insp_info, sent]

            def inspector_fn(selected, ax, is_live, sent_state, force=False):
                """Timer handler: read the producer's latest snapshot; send only what changed."""
                pub = host.published
                sent_state = dict(sent_state or {})
                if (not is_live and not force) or pub.snapshot is None:
                    return (*[gr.skip()] * 9, sent_state)
                res = []

                def send(key, sig, make):
                    if not force and sent_state.get(key) == sig:
                        return gr.skip()
                    try:
                        v = make()
                    except Exception as e:  # one broken chart never takes the others down
                        log.exception("inspector chart %s failed", key)
                        v = spec_plot(F.error_spec(key, e))
                    sent_state[key] = sig
                    return v

                if selected:
                    res.append(send("block_map", (pub.version, selected),
                                    lambda: spec_plot(F.block_map_spec(pub.kv, highlight=selected))))
                else:
                    res.append(send("block_map", pub.hashes.get("block_map"), lambda: plot(pub.plots["block_map"])))
                res.append(send("block_table", (pub.version, selected),
                                lambda: spec_plot(F.block_table_spec(pub.kv, selected))))
                tl = "timeline_step" if ax == "step" else "timeline"
                if ax == "step":
                    host.want_step_axis_until = time.monotonic() + 10.0
                    if tl not in pub.plots:            # first request for it: build it here once
                        res.append(send("timeline", ("step-adhoc", pub.version),
                                        lambda: spec_plot(F.timeline_spec(pub.snapshot, axis="step"))))
                        host._kick.set()
                    else:
                        res.append(send("timeline", (tl, pub.hashes.get(tl)), lambda: plot(pub.plots[tl])))
                else:
                    res.append(send("timeline", (tl, pub.hashes.get(tl)), lambda: plot(pub.plots[tl])))
                for name in ("throughput", "latency", "timings", "spec"):
                    res.append(send(name, pub.hashes.get(name), lambda n=name: plot(pub.plots[n])))
                snap = pub.snapshot
                holding = sorted((pub.kv or {}).get("block_tables", {}).keys())
                recent = [r.request_id for r in snap.requests[-30:]][::-1]
                choices = list(dict.fromkeys(holding + recent))
                ck = hash(tuple(choices))
                if sent_state.get("choices") != ck or force:
                    sent_state["choices"] = ck
                    res.append(gr.update(choices=choices))
                else:
                    res.append(gr.skip())
                t = snap.totals
                info = (f"<sub>snapshot #{pub.version} · built in {pub.build_ms:.0f} ms · {t.get('steps', 0)} steps, "
                        f"{len(snap.requests)} requests recorded"
                        + (f" · {snap.dropped_events} events dropped (ring buffer)" if snap.dropped_events else "")
                        + "</sub>")
                res.append(send("info", info, lambda: info))
                return (*res, sent_state)

            insp_timer = gr.Timer(1.0)
            insp_timer.tick(inspector_fn, [req_dd, axis, live, sent], outs, concurrency_limit=None,
                            show_progress="hidden", api_visibility="private")
            req_dd.change(lambda s, a, lv, st: inspector_fn(s, a, lv, st, force=True), [req_dd, axis, live, sent], outs,
                          concurrency_limit=None, show_progress="hidden", api_visibility="private")
            axis.change(lambda s, a, lv, st: inspector_fn(s, a, lv, st, force=True), [req_dd, axis, live, sent], outs,
                        concurrency_limit=None, show_progress="hidden", api_visibility="private")

            def inspector(selected: str = "", axis: str = "time") -> dict:
                """For API clients and tests: a fresh snapshot; every chart as Plotly JSON plus the kv snapshot."""
                pub = host.publish()
                plots = dict(pub.plots)
                if selected:
                    plots["block_map"] = F.to_json(F.block_map_spec(pub.kv, highlight=selected))
                plots["block_table"] = F.to_json(F.block_table_spec(pub.kv, selected or None))
                snap = pub.snapshot
                return {"plots": plots, "kv": pub.kv, "stats": pub.stats, "totals": snap.totals,
                        "requests": [dict(request_id=r.request_id, status=r.status, prompt_len=r.prompt_len,
                                          output_len=r.output_len, num_preemptions=r.num_preemptions,
                                          phases=sorted({sp.phase for sp in r.spans})) for r in snap.requests]}

            gr.api(inspector, api_name="inspector", concurrency_limit=None)

            def profile_fn():
                try:
                    loop = host.require_loop()
                except EngineUnavailable as e:
                    return str(e), gr.update(visible=False)
                if not can_profile(loop):
                    return "This engine has no `profile_step()`: per-kernel profiling is unavailable.", gr.update(visible=False)
                st = loop.stats()
                if not (st.get("num_running") or st.get("num_waiting")):
                    return ("The profiler records the next engine step: start a load or send a prompt first, then "
                            "press again while requests run."), gr.update(visible=False)
                try:
                    rows = profile_one_step(loop, timeout=15.0)
                except Exception as e:
                    log.exception("profile failed")
                    return f"Profiling failed: {type(e).__name__}: {e}", gr.update(visible=False)
                if not rows:
                    return "No step ran while profiling (the engine went idle).", gr.update(visible=False)
                host.profile_rows = rows
                return (f"Profiled one step: {len(rows)} ops/kernels (self time; Triton kernels in red).",
                        gr.update(value=spec_plot(F.profile_spec(rows)), visible=True))

            prof_btn.click(profile_fn, None, [prof_msg, p_prof], api_name="profile_step", concurrency_limit=1)

        # ------------------------------------------------------------------ Engine settings
        with gr.Tab("Engine settings", id="settings"):
            gr.Markdown("Every `EngineConfig` switch. **Apply** validates, stops any running load, and restarts the "
                        "engine with the new settings (the model reloads).")
            fspecs = config_field_specs()
            names = [n for n, _, _ in fspecs]
            comps = []
            cur = config_form_values(host.config, names)
            per_row = 4
            for i in range(0, len(fspecs), per_row):
                with gr.Row():
                    for (name, kind, _), val in zip(fspecs[i:i + per_row], cur[i:i + per_row]):
                        info = _HELP.get(name)
                        if kind == "bool":
                            c = gr.Checkbox(value=bool(val), label=name, info=info)
                        elif kind == "choice":
                            c = gr.Dropdown(_CHOICES[name], value=val, label=name, allow_custom_value=(name == "device"),
                                            info=info)
                        elif kind in ("int", "opt_int"):
                            c = gr.Number(value=val, precision=0, label=name, info=info,
                                          placeholder="empty = default" if kind == "opt_int" else None)
                        elif kind in ("float", "opt_float"):
                            c = gr.Number(value=val, label=name, info=info,
                                          placeholder="empty = default" if kind == "opt_float" else None)
                        else:
                            c = gr.Textbox(value=val, label=name, info=info)
                        comps.append(c)
            with gr.Row():
                apply_btn = gr.Button("Apply and restart engine", variant="primary", elem_id="kv-apply")
                reset_btn = gr.Button("Show current settings")
            apply_msg = gr.Markdown()

            def apply_fn(*vals):
                try:
                    cfg = config_from_form(names, list(vals))
                except ValueError as e:
                    return f"⚠️ {e}"
                try:
                    return "✅ " + host.restart(cfg)
                except EngineUnavailable as e:
                    return f"⚠️ {e}"

            apply_btn.click(apply_fn, comps, apply_msg, api_name="apply_settings", concurrency_limit=1)
            reset_btn.click(lambda: config_form_values(host.config, names), None, comps, api_visibility="private", queue=False)

        # ------------------------------------------------------------------ Compare
        with gr.Tab("Compare", id="compare"):
            gr.Markdown("Run the **same seeded workload** under two configurations (each on a fresh engine with the "
                        "current model, one after the other) and compare metrics and timelines side by side. "
                        "The main engine keeps serving meanwhile.")
            cmp_fields = [("enable_chunked_prefill", "bool"), ("enable_prefix_caching", "bool"), ("enable_kv_cache", "bool"),
                          ("scheduling", "choice"), ("max_num_batched_tokens", "int"), ("max_num_seqs", "int"),
                          ("num_kv_blocks", "opt_int"), ("block_size", "int"), ("kernels", "choice"),
                          ("enable_cuda_graphs", "bool"), ("speculative_method", "choice"), ("num_speculative_tokens", "int")]
            cmp_names = [n for n, _ in cmp_fields]
            sides = {}
            with gr.Row():
                for label in ("A", "B"):
                    with gr.Column():
                        gr.Markdown(f"**Config {label}**")
                        cs = []
                        vals = config_form_values(host.config, cmp_names)
                        for (name, kind), val in zip(cmp_fields, vals):
                            if label == "B" and name == "scheduling":
                                val = "static" if val == "continuous" else "continuous"   # the classic contrast
                            if kind == "bool":
                                cs.append(gr.Checkbox(value=bool(val), label=name))
                            elif kind == "choice":
                                cs.append(gr.Dropdown(_CHOICES[name], value=val, label=name))
                            else:
                                cs.append(gr.Number(value=val, precision=0, label=name))
                        sides[label] = cs
            with gr.Row():
                cmp_preset = gr.Dropdown(list(L.PRESETS), value="One burst", label="workload preset")
                cmp_n = gr.Number(value=16, precision=0, label="number of requests")
                cmp_seed = gr.Number(value=0, precision=0, label="seed")
                cmp_omax = gr.Number(value=64, precision=0, label="output max tokens")
                cmp_run = gr.Button("Run comparison", variant="primary", elem_id="kv-compare-run")
                cmp_stop = gr.Button("Stop", variant="stop")
            cmp_msg = gr.Markdown()
            cmp_table = gr.Dataframe(headers=["Metric", "A", "B", "B / A", "Better"], label="A vs B (same seeded workload)",
                                     interactive=False, elem_id="kv-compare-table")
            with gr.Row():
                cmp_tl_a = gr.Plot(label="A timeline", show_label=False)
                cmp_tl_b = gr.Plot(label="B timeline", show_label=False)

            def compare_fn(*vals):
                try:
                    loop = host.require_loop()
                    if host.compare is not None and not host.compare.done.is_set():
                        raise ValueError("a comparison is already running")
                    if host.load is not None and not host.load.done:
                        raise ValueError("a load is running on the main engine; stop it first for a fair comparison")
                    k = len(cmp_names)
                    a_vals, b_vals, (pname, n, sd, omax) = vals[:k], vals[k:2 * k], vals[2 * k:]
                    base = host.config
                    cfgs = {}
                    for label, vs in (("A", a_vals), ("B", b_vals)):
                        names_all = config_field_specs()
                        full = dict(zip([x[0] for x in names_all], config_form_values(base, [x[0] for x in names_all])))
                        full.update(dict(zip(cmp_names, vs)))
                        cfgs[label] = config_from_form(list(full), list(full.values()))
                    info = L.EngineInfo.from_loop(loop)
                    nn = _num(n, "number of requests", integer=True, lo=1, hi=2000)
                    spec = L.preset(pname, info, num_requests=nn, seed=_num(sd, "seed", integer=True, lo=0))
                    om = _num(omax, "output max tokens", integer=True, lo=1)
                    spec.output_len = L.LengthDist(spec.output_len.kind, min(spec.output_len.low, om), om)
                    spec.validate(info.max_model_len)
                except (ValueError, EngineUnavailable) as e:
                    return f"⚠️ {e}"
                host.compare = CompareJob(cfgs, spec, None, loop_factory=host.loop_factory).start()
                return f"Running **{spec.name}** ({spec.num_requests} requests, seed {spec.seed}) under A, then B…"

            cmp_run.click(compare_fn, [*sides["A"], *sides["B"], cmp_preset, cmp_n, cmp_seed, cmp_omax], cmp_msg,
                          api_name="compare", concurrency_limit=1)
            cmp_stop.click(lambda: (host.compare.stop() if host.compare else None) or "Stopping the comparison.",
                           None, cmp_msg, api_visibility="private", queue=False)
            cmp_shown = gr.State(None)

            def compare_status(shown_id):
                job = host.compare
                if job is None:
                    return gr.skip(), gr.skip(), gr.skip(), gr.skip(), shown_id
                if not job.done.is_set():
                    prog_txt = job.status
                    if job.runner is not None:
                        prog_txt += " — " + L.format_progress(job.runner.progress())
                    return prog_txt, gr.skip(), gr.skip(), gr.skip(), shown_id
                if shown_id == id(job):
                    return gr.skip(), gr.skip(), gr.skip(), gr.skip(), shown_id
                if job.error:
                    return f"⚠️ comparison failed: {job.error}", gr.skip(), gr.skip(), gr.skip(), id(job)
                errs = "".join(f"<br>⚠️ config {k}: {v}" for k, v in job.errors.items())
                if not job.results:
                    return f"Comparison {job.status}.{errs}", gr.skip(), gr.skip(), gr.skip(), id(job)
                tbl = compare_table(job.results)
                figs = []
                for label in ("A", "B"):
                    snap = job.snapshots.get(label)
                    if snap is None:
                        figs.append(spec_plot(F.empty_spec(f"{label}", "did not run", 300)))
                    else:
                        sp = F.timeline_spec(snap, max_requests=32)
                        sp["layout"]["title"]["text"] = f"Config {label} — " + sp["layout"]["title"]["text"]
                        figs.append(spec_plot(sp))
                return f"Comparison {job.status}.{errs}", tbl, figs[0], figs[1], id(job)

            def compare_report() -> dict:
                """For API clients: the comparison's status and, when done, each config's summary."""
                job = host.compare
                if job is None:
                    return {"status": None}
                return {"status": job.status, "done": job.done.is_set(), "error": job.error, "errors": job.errors,
                        "results": job.results if job.done.is_set() else None,
                        "table": compare_table(job.results).to_dict("records") if job.done.is_set() and job.results else None}

            gr.api(compare_report, api_name="compare_report", concurrency_limit=None)

            cmp_timer = gr.Timer(1.0)
            cmp_timer.tick(compare_status, cmp_shown, [cmp_msg, cmp_table, cmp_tl_a, cmp_tl_b, cmp_shown],
                           concurrency_limit=None, show_progress="hidden", api_visibility="private")

        # ------------------------------------------------------------------ Export
        with gr.Tab("Export", id="export"):
            gr.Markdown("Download what the inspector recorded: per-request metrics (CSV, one row per finished request, "
                        "latencies in ms), per-step records (CSV), and the timeline as Chrome-trace JSON — open it in "
                        "[Perfetto](https://ui.perfetto.dev) or `chrome://tracing`.")
            with gr.Row():
                b_csv = gr.Button("Metrics CSV", elem_id="kv-export-csv")
                b_steps = gr.Button("Steps CSV")
                b_trace = gr.Button("Chrome trace JSON", elem_id="kv-export-trace")
            exp_files = gr.File(label="Downloads", file_count="multiple", interactive=False, elem_id="kv-export-files")
            outdir = Path(tempfile.mkdtemp(prefix="kvscope-export-"))

            def _export(kind: str):
                snap = host.recorder.snapshot(kv=None)
                stamp = time.strftime("%Y%m%d-%H%M%S")
                if kind == "csv":
                    if not snap.records:
                        raise gr.Error("no finished requests recorded yet")
                    p = outdir / f"kvscope-metrics-{stamp}.csv"
                    X.metrics_csv(snap.records, p)
                elif kind == "steps":
                    if not snap.steps:
                        raise gr.Error("no engine steps recorded yet")
                    p = outdir / f"kvscope-steps-{stamp}.csv"
                    X.steps_frame(snap).to_csv(p, index=False)
                else:
                    if not snap.steps and not snap.requests:
                        raise gr.Error("nothing recorded yet")
                    p = outdir / f"kvscope-trace-{stamp}.json"
                    X.chrome_trace_json(snap, p)
                return [str(p)]

            b_csv.click(lambda: _export("csv"), None, exp_files, api_name="export_csv")
            b_steps.click(lambda: _export("steps"), None, exp_files, api_name="export_steps")
            b_trace.click(lambda: _export("trace"), None, exp_files, api_name="export_trace")

    return demo


# =============================================================================== app assembly
def add_serving_api(app, host: EngineHost) -> bool:
    """Let the serving API (engine/entrypoints/openai/api_server.py) register its routes on `app`.
    Its module may define `register(app, get_loop)`; returns True when routes were added."""
    try:
        from engine.entrypoints.openai import api_server  # type: ignore
    except Exception:
        return False
    reg = getattr(api_server, "register", None)
    if reg is None:
        return False
    reg(app, lambda: host.require_loop(), **host.api_options)
    return True


def create_app(host: EngineHost, api_only: bool = False, with_api: bool = True):
    """A FastAPI app: serving API routes first (if available), then the Gradio UI mounted at '/'."""
    from fastapi import FastAPI
    app = FastAPI(title="kvscope")
    has_api = add_serving_api(app, host) if (with_api or api_only) else False
    if api_only:
        if not has_api:
            raise SystemExit("--api-only: the serving API module is not available in this build")
        return app, None

    @app.get("/healthz")
    def healthz():
        return {"state": host.state, "engine": host.describe()}

    demo = build_ui(host)
    app = gr.mount_gradio_app(app, demo, path="/", css=CSS, theme=gr.themes.Soft(), footer_links=[],
                              show_error=True, run_history=False)
    return app, demo


class ServerHandle:
    """A uvicorn server on a background thread (tests, notebooks): `.url`, `.stop()`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn
        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}/"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, name="kvscope-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerHandle":
        self.thread.start()
        deadline = time.time() + timeout
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def serve_in_thread(host: EngineHost, port: int = 0, bind: str = "127.0.0.1") -> ServerHandle:
    """Build the app around a started EngineHost and serve it on a background thread."""
    app, _ = create_app(host)
    srv = ServerHandle(app, bind, port).start()
    host.self_url = srv.url.rstrip("/")
    return srv


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="kvscope: an LLM inference engine you can see into")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=7860)
    ap.add_argument("--model", default=None, help="HF folder, dummy:<preset>, or empty for the bundled SmolLM2")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any EngineConfig field, e.g. --set num_kv_blocks=256 (repeatable)")
    ap.add_argument("--api-only", action="store_true", help="serve only the HTTP serving API (no UI)")
    ap.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/* (401 otherwise)")
    ap.add_argument("--served-model-name", default=None, help="the model id API clients send (default: the model's)")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="API: seconds before a request is aborted with 504 (0: never)")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20, help="API: larger request bodies get 413")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def config_from_args(args) -> EngineConfig:
    kw: dict[str, Any] = {"model": args.model or None, "device": args.device}
    kinds = {n: k for n, k, _ in config_field_specs()}
    for item in args.set:
        if "=" not in item:
            raise SystemExit(f"--set {item!r}: expected FIELD=VALUE")
        k, v = item.split("=", 1)
        if k not in kinds:
            raise SystemExit(f"--set: unknown EngineConfig field {k!r}; fields: {', '.join(kinds)}")
        kind = kinds[k]
        if v.lower() in ("none", "null", ""):
            kw[k] = None
        elif kind == "bool":
            kw[k] = v.lower() in ("1", "true", "yes", "on")
        elif kind in ("int", "opt_int"):
            kw[k] = int(v)
        elif kind in ("float", "opt_float"):
            kw[k] = float(v)
        else:
            kw[k] = v
    try:
        return EngineConfig(**kw)
    except ValueError as e:
        raise SystemExit(str(e))


def api_options_from_args(args) -> dict:
    """register() keyword arguments of the serving API from app.py's flags."""
    if args.request_timeout < 0:
        raise SystemExit(f"--request-timeout: must be >= 0 seconds (got {args.request_timeout})")
    if args.max_body_bytes < 1024:
        raise SystemExit(f"--max-body-bytes: must be >= 1024 (got {args.max_body_bytes})")
    return dict(api_key=args.api_key or None, served_model_name=args.served_model_name,
                request_timeout=args.request_timeout or None, max_body_bytes=args.max_body_bytes)


def main(argv=None) -> None:
    import uvicorn
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = config_from_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)     # the HTTP load target: no line per request
    host = EngineHost(cfg)
    host.api_options = api_options_from_args(args)
    host.self_url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::', '') else args.host}:{args.port}"
    log.info("loading the engine (%s)…", cfg.model or "bundled SmolLM2-135M-Instruct")
    host.start(inspect=not args.api_only)
    app, _ = create_app(host, api_only=args.api_only)
    print(f"kvscope ready on http://{args.host}:{args.port}  ({host.describe()})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=2)
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
