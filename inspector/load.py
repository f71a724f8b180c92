"""Simulated users: arrival processes, workload presets, and a runner that drives an EngineLoop in-process.

Arrivals follow `vllm bench serve`: inter-arrival times are gamma distributed with shape k = burstiness
and scale 1 / (rate * k), so the mean rate is `rate` for every k; k = 1 is a Poisson process, k < 1 is
burstier, k > 1 more regular. rate = inf sends everything at once.

Prompts are random token ids (seeded, special tokens excluded) so their lengths are exact; outputs
use greedy decoding with `ignore_eos` by default so their lengths are exact too.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import numpy as np

from inspector import metrics as M
from inspector.recorder import RequestRecord

log = logging.getLogger(__name__)

MAX_REQUESTS = 10_000
MAX_CONCURRENCY = 4096
MAX_RATE = 10_000.0
_run_ids = itertools.count(1)


# ----------------------------------------------------------------------------- arrivals
def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int | None = 0) -> np.ndarray:
    """Arrival offsets (s) of n requests: the first at 0, then gamma(k=burstiness, scale=1/(rate*k)) gaps."""
    if n <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError(f"rate: must be > 0 requests/s (got {rate!r})")
    if not burstiness > 0:
        raise ValueError(f"burstiness: must be > 0 (got {burstiness!r})")
    if math.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


# ----------------------------------------------------------------------------- lengths
LENGTH_KINDS = ("fixed", "uniform", "normal", "lognormal")


@dataclass
class LengthDist:
    """Token lengths in [low, high]. fixed: always `low`; uniform: integers in [low, high];
    normal: mean (low+high)/2, std (high-low)/4, clipped; lognormal: median sqrt(low*high), long tail, clipped."""
    kind: str = "uniform"
    low: int = 32
    high: int = 128

    def validate(self, name: str) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"{name}: distribution must be one of {LENGTH_KINDS} (got {self.kind!r})")
        for v, what in ((self.low, "min"), (self.high, "max")):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"{name} {what}: must be a whole number of tokens (got {v!r})")
            if v < 1:
                raise ValueError(f"{name} {what}: must be >= 1 token (got {v})")
        if self.kind != "fixed" and self.high < self.low:
            raise ValueError(f"{name}: max ({self.high}) must be >= min ({self.low})")

    @property
    def max(self) -> int:
        return self.low if self.kind == "fixed" else self.high

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        lo, hi = int(self.low), int(max(self.high, self.low))
        if self.kind == "fixed" or lo == hi:
            return np.full(n, lo, dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(lo, hi + 1, size=n)
        if self.kind == "normal":
            x = rng.normal((lo + hi) / 2, (hi - lo) / 4, size=n)
        else:  # lognormal
            x = rng.lognormal(math.log(math.sqrt(lo * hi)), max(1e-6, math.log(hi / lo) / 4), size=n)
        return np.clip(np.rint(x), lo, hi).astype(np.int64)


# ----------------------------------------------------------------------------- spec
@dataclass
class LoadSpec:
    name: str = "custom"
    num_requests: int = 32
    rate: float = 4.0                   # requests/s (users/s for multi-turn); inf = all at once
    burstiness: float = 1.0             # gamma shape k; 1 = Poisson
    max_concurrency: int | None = None  # None: unlimited
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 64, 256))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("uniform", 32, 128))
    seed: int = 0
    shared_prefix_len: int = 0          # tokens of one system prompt shared by every request
    num_turns: int = 1                  # > 1: multi-turn chat; num_requests = users * turns
    think_time_s: float = 0.0           # pause between a reply and the user's next turn
    temperature: float = 0.0
    ignore_eos: bool = True
    description: str = ""

    @property
    def num_users(self) -> int:
        return max(1, math.ceil(self.num_requests / max(1, self.num_turns)))

    def max_total_len(self) -> int:
        """Longest prompt + output any request of this workload can have."""
        return self.shared_prefix_len + self.num_turns * (self.prompt_len.max + self.output_len.max)

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise ValueError with a message naming the knob, for any input the runner cannot honour."""
        def bad(name, msg, v):
            raise ValueError(f"{name}: {msg} (got {v!r})")

        n = self.num_requests
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            bad("number of requests", "must be a whole number >= 1", n)
        if n > MAX_REQUESTS:
            bad("number of requests", f"too many simulated users; at most {MAX_REQUESTS}", n)
        if self.rate is None or not (self.rate > 0):
            bad("rate", "must be > 0 requests/s (use 'all at once' for a burst)", self.rate)
        if not math.isinf(self.rate) and self.rate > MAX_RATE:
            bad("rate", f"at most {MAX_RATE:g} requests/s (or 'all at once')", self.rate)
        if self.burstiness is None or not (0 < self.burstiness <= 100):
            bad("burstiness", "must be in (0, 100]; 1 = Poisson, < 1 burstier", self.burstiness)
        if self.max_concurrency is not None and not (1 <= self.max_concurrency <= MAX_CONCURRENCY):
            bad("max concurrency", f"must be empty/0 (unlimited) or in [1, {MAX_CONCURRENCY}]", self.max_concurrency)
        self.prompt_len.validate("prompt length")
        self.output_len.validate("output length")
        if self.seed is None or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            bad("seed", "must be a whole number >= 0", self.seed)
        if self.shared_prefix_len < 0:
            bad("shared prefix length", "must be >= 0", self.shared_prefix_len)
        if not (1 <= self.num_turns <= 64):
            bad("turns per user", "must be in [1, 64]", self.num_turns)
        if self.think_time_s < 0 or self.think_time_s > 600:
            bad("think time", "must be in [0, 600] s", self.think_time_s)
        if self.temperature < 0:
            bad("temperature", "must be >= 0", self.temperature)
        if max_model_len is not None and self.max_total_len() > max_model_len:
            raise ValueError(
                f"lengths: the longest request would need {self.max_total_len()} tokens (shared prefix + "
                f"turns x (prompt max + output max)) but the engine's max_model_len is {max_model_len}; "
                "lower the maximum prompt/output lengths")

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- presets
@dataclass
class EngineInfo:
    num_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    vocab_size: int = 32000

    @classmethod
    def from_loop(cls, loop) -> "EngineInfo":
        eng = loop.engine
        cfg = eng.config
        mml = getattr(eng, "max_model_len", None) or cfg.max_model_len or 2048
        tok = getattr(eng, "tokenizer", None)
        vocab = getattr(tok, "vocab_size", None) or 32000
        mv = getattr(getattr(eng, "model_config", None), "vocab_size", None)
        if mv:
            vocab = min(vocab, mv)
        return cls(num_blocks=int(getattr(eng, "num_blocks", 512)), block_size=int(getattr(eng, "block_size", cfg.block_size)),
                   max_model_len=int(mml), max_num_batched_tokens=cfg.max_num_batched_tokens,
                   max_num_seqs=cfg.max_num_seqs, enable_chunked_prefill=cfg.enable_chunked_prefill,
                   vocab_size=int(vocab))


def _fit(d: LengthDist, cap: int) -> LengthDist:
    cap = max(1, int(cap))
    return LengthDist(d.kind, max(1, min(d.low, cap)), max(1, min(d.high, cap)))


def _steady(info: EngineInfo) -> LoadSpec:
    return LoadSpec("Steady Poisson", 32, 4.0, 1.0, None, LengthDist("uniform", 64, 256), LengthDist("uniform", 32, 128),
                    description="Poisson arrivals (burstiness 1) at a steady rate: the everyday serving case.")


def _burst(info: EngineInfo) -> LoadSpec:
    return LoadSpec("One burst", 32, math.inf, 1.0, None, LengthDist("uniform", 64, 256), LengthDist("uniform", 32, 128),
                    description="Every request arrives at once: watch the waiting queue drain and the batch fill.")


def _long(info: EngineInfo) -> LoadSpec:
    out = LengthDist("uniform", 16, 32)
    budget = info.max_num_batched_tokens
    hi = int(budget * 1.5) if info.enable_chunked_prefill else budget
    hi = max(2, min(hi, info.max_model_len - out.high - 1))
    lo = max(1, min(int(budget * 0.75), hi))
    return LoadSpec("Long prompts (chunked prefill)", 6, 0.5, 1.0, None, LengthDist("uniform", lo, hi), out,
                    description=f"Prompts of {lo}–{hi} tokens against a {budget}-token step budget: prefills are "
                                "split into chunks that share steps with other requests' decodes.")


def _short_chats(info: EngineInfo) -> LoadSpec:
    return LoadSpec("Many short chats", 96, 24.0, 0.5, 48, LengthDist("uniform", 16, 64), LengthDist("uniform", 8, 48),
                    description="Many users with short prompts and replies, bursty arrivals (k = 0.5), at most 48 in flight.")


def _memory_pressure(info: EngineInfo) -> LoadSpec:
    capacity = info.num_blocks * info.block_size          # tokens the KV pool can hold
    conc = max(2, min(16, info.max_num_seqs))
    per = min(math.ceil(1.6 * capacity / conc), info.max_model_len - 1)
    if per * conc < 1.3 * capacity:
        conc = max(2, min(info.max_num_seqs, math.ceil(1.6 * capacity / max(per, 1))))
    prompt = max(1, per // 4)
    output = max(1, per - prompt)
    n = conc + conc // 2
    return LoadSpec("Memory pressure (preemption)", n, math.inf, 1.0, None,
                    LengthDist("uniform", max(1, int(prompt * 0.9)), prompt), LengthDist("uniform", max(1, int(output * 0.9)), output),
                    description=f"{n} requests of up to {per} tokens each against a pool of {capacity} tokens "
                                f"({info.num_blocks} blocks × {info.block_size}): decodes outgrow the pool and the "
                                "scheduler preempts. On a CPU, lower num_kv_blocks in Engine settings for a quick demo.")


def _shared_prefix(info: EngineInfo) -> LoadSpec:
    prefix = max(4 * info.block_size, 256)
    prefix = min(prefix, max(0, info.max_model_len - 64 - 64 - 1))
    return LoadSpec("Shared system prompt (prefix caching)", 32, 8.0, 1.0, None, LengthDist("uniform", 16, 64),
                    LengthDist("uniform", 16, 64), shared_prefix_len=prefix,
                    description=f"Every request starts with the same {prefix}-token system prompt: with prefix caching "
                                "its blocks are computed once and shared (see the block map and the cache hit rate).")


def _multi_turn(info: EngineInfo) -> LoadSpec:
    return LoadSpec("Multi-turn chat", 32, 2.0, 1.0, None, LengthDist("uniform", 16, 64), LengthDist("uniform", 16, 48),
                    num_turns=4, think_time_s=0.2,
                    description="8 users × 4 turns: each turn resends the whole conversation, so earlier turns hit the "
                                "prefix cache.")


PRESETS: dict[str, Callable[[EngineInfo], LoadSpec]] = {
    "Steady Poisson": _steady,
    "One burst": _burst,
    "Long prompts (chunked prefill)": _long,
    "Many short chats": _short_chats,
    "Memory pressure (preemption)": _memory_pressure,
    "Shared system prompt (prefix caching)": _shared_prefix,
    "Multi-turn chat": _multi_turn,
}


def preset(name: str, info: EngineInfo | None = None, **overrides) -> LoadSpec:
    if name not in PRESETS:
        raise ValueError(f"preset: unknown {name!r}; choose one of {list(PRESETS)}")
    info = info or EngineInfo()
    spec = PRESETS[name](info)
    # keep presets inside the engine's limits
    room = info.max_model_len - 1 - spec.shared_prefix_len
    per_turn = max(2, room // max(1, spec.num_turns))
    if spec.prompt_len.max + spec.output_len.max > per_turn:
        out_cap = max(1, min(spec.output_len.max, per_turn // 2))
        spec.output_len = _fit(spec.output_len, out_cap)
        spec.prompt_len = _fit(spec.prompt_len, per_turn - spec.output_len.max)
    return replace(spec, **overrides) if overrides else spec


# ----------------------------------------------------------------------------- workload
@dataclass
class LoadItem:
    index: int
    user: int
    turn: int
    arrival: float          # offset (s) for first turns; later turns are due after the previous reply
    new_tokens: list[int]   # this turn's new prompt tokens (the runner prepends the conversation)
    max_tokens: int


def _token_pool(vocab_size: int, special_ids=()) -> np.ndarray:
    lo = min(1000, max(1, vocab_size // 10))
    pool = np.arange(lo, max(lo + 1, vocab_size), dtype=np.int64)
    if special_ids:
        pool = pool[~np.isin(pool, np.asarray(list(special_ids), dtype=np.int64))]
    return pool


def build_workload(spec: LoadSpec, vocab_size: int = 32000, special_ids=()) -> tuple[list[int], list[LoadItem]]:
    """(shared prefix tokens, items) for the spec; deterministic for a seed."""
    rng = np.random.default_rng(spec.seed)
    pool = _token_pool(vocab_size, special_ids)
    prefix = rng.choice(pool, size=spec.shared_prefix_len).tolist() if spec.shared_prefix_len else []
    turns = max(1, spec.num_turns)
    users = spec.num_users if turns > 1 else spec.num_requests
    arrivals = arrival_times(users, spec.rate, spec.burstiness, seed=spec.seed + 1)
    p_lens = spec.prompt_len.sample(spec.num_requests, rng)
    o_lens = spec.output_len.sample(spec.num_requests, rng)
    items = []
    for i in range(spec.num_requests):
        user, turn = (i // turns, i % turns) if turns > 1 else (i, 0)
        items.append(LoadItem(index=i, user=user, turn=turn, arrival=float(arrivals[user]) if turn == 0 else 0.0,
                              new_tokens=rng.choice(pool, size=int(p_lens[i])).tolist(), max_tokens=int(o_lens[i])))
    return prefix, items


# ----------------------------------------------------------------------------- runner
class LoadRunner:
    """Simulated users driving `loop` (an EngineLoop: submit(prompt, params, request_id) -> stream).

    `start()` returns at once; `progress()` and `summary()` can be polled from any thread; `stop()`
    cancels everything in flight (their KV blocks are freed by the engine)."""

    def __init__(self, loop, spec: LoadSpec, recorder=None, slo: M.SLO | None = None,
                 sampling_factory: Callable[..., Any] | None = None, vocab_size: int | None = None,
                 special_ids=None, max_model_len: int | None = None):
        self.loop = loop
        self.spec = spec
        self.recorder = recorder
        self.slo = slo
        self.run_id = next(_run_ids)
        info = None
        if vocab_size is None or max_model_len is None:
            try:
                info = EngineInfo.from_loop(loop)
            except Exception:
                info = EngineInfo()
        self.vocab_size = vocab_size or info.vocab_size
        self.max_model_len = max_model_len or (info.max_model_len if info else None)
        if special_ids is None:
            tok = getattr(getattr(loop, "engine", None), "tokenizer", None)
            special_ids = list(getattr(tok, "all_special_ids", []) or [])
        self.special_ids = special_ids
        spec.validate(self.max_model_len)
        self._sampling_factory = sampling_factory
        self.prefix, self.items = build_workload(spec, self.vocab_size, self.special_ids)
        self.records: list[RequestRecord] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._done = threading.Event()
        self._streams: dict[str, Any] = {}
        self._submitted = 0
        self._finished = 0
        self._failed = 0
        self._t_start: float | None = None
        self._t_end: float | None = None
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None

    # ------------------------------------------------------------------ control
    def start(self) -> "LoadRunner":
        self._t_start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=f"kvscope-load-{self.run_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            streams = list(self._streams.values())
            self._cond.notify_all()
        for s in streams:
            try:
                s.cancel()
            except Exception:
                log.exception("cancel failed")

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def progress(self) -> dict:
        with self._lock:
            total = len(self.items)
            now = self._t_end or time.perf_counter()
            return dict(run_id=self.run_id, name=self.spec.name, total=total, submitted=self._submitted,
                        finished=self._finished, failed=self._failed,
                        in_flight=max(0, self._submitted - self._finished - self._failed),
                        not_sent=total - self._submitted,
                        elapsed_s=(now - self._t_start) if self._t_start else 0.0,
                        fraction=(self._finished + self._failed) / total if total else 1.0,
                        done=self._done.is_set(), stopped=self._stop.is_set(), errors=list(self.errors[-5:]))

    def summary(self) -> dict:
        if self._summary is not None:
            return self._summary
        with self._lock:
            recs = list(self.records)
        s = M.summarize(recs, slo=self.slo)
        s["num_requests"] = len(self.items)
        s["failed"] = self._failed
        s["not_sent"] = len(self.items) - self._submitted
        s["stopped"] = self._stop.is_set()
        if self._done.is_set():
            self._summary = s
        return s

    # ------------------------------------------------------------------ internals
    def _params(self, max_tokens: int):
        if self._sampling_factory is not None:
            return self._sampling_factory(max_tokens=max_tokens, temperature=self.spec.temperature,
                                          ignore_eos=self.spec.ignore_eos, seed=self.spec.seed)
        from engine.sampling_params import SamplingParams
        return SamplingParams(max_tokens=max_tokens, temperature=self.spec.temperature,
                              ignore_eos=self.spec.ignore_eos, seed=self.spec.seed)

    def _run(self) -> None:
        spec = self.spec
        conc = spec.max_concurrency
        sem = threading.Semaphore(conc) if conc else None
        turns = max(1, spec.num_turns)
        by_user: dict[int, list[LoadItem]] = {}
        for it in self.items:
            by_user.setdefault(it.user, []).append(it)
        history: dict[int, list[int]] = {u: list(self.prefix) for u in by_user}
        heap: list[tuple[float, int, LoadItem]] = []
        t0 = self._t_start or time.perf_counter()
        for it in self.items:
            if it.turn == 0:
                heap.append((t0 + it.arrival, it.index, it))
        heapq.heapify(heap)
        remaining = [len(self.items)]
        pool = ThreadPoolExecutor(max_workers=min(256, max(4, conc or min(len(self.items), 64))),
                                  thread_name_prefix=f"kvscope-load-{self.run_id}-wait")

        def finish_one(it: LoadItem, out, err: str | None):
            with self._lock:
                if err is None and out is not None:
                    rec = RequestRecord.from_output(out)
                    self.records.append(rec)
                    if out.finish_reason in ("abort",):
                        self._failed += 1
                    else:
                        self._finished += 1
                    if turns > 1 and it.turn + 1 < turns and not self._stop.is_set():
                        nxt = by_user[it.user][it.turn + 1]
                        history[it.user] = history[it.user] + it.new_tokens + list(out.token_ids)
                        heapq.heappush(heap, (time.perf_counter() + spec.think_time_s, nxt.index, nxt))
                    elif turns > 1:
                        remaining[0] -= sum(1 for x in by_user[it.user][it.turn + 1:])
                else:
                    self._failed += 1
                    self.errors.append(f"request {it.index}: {err}")
                    if turns > 1:   # the rest of this user's conversation cannot happen
                        skipped = len(by_user[it.user][it.turn + 1:])
                        remaining[0] -= skipped
                        self._failed += skipped
                remaining[0] -= 1
                self._cond.notify_all()
            if err is None and out is not None and self.recorder is not None:
                try:
                    self.recorder.record_output(out)
                except Exception:
                    log.exception("recorder.record_output failed")

        def wait_for(it: LoadItem, rid: str, stream):
            out, err = None, None
            try:
                out = stream.result()
            except Exception as e:  # an error in one request never takes the load down
                err = f"{type(e).__name__}: {e}"
            finally:
                if sem is not None:
                    sem.release()
                with self._lock:
                    self._streams.pop(rid, None)
            finish_one(it, out, err)

        try:
            while True:
                with self._lock:
                    if self._stop.is_set() or remaining[0] <= 0:
                        break
                    if not heap:
                        self._cond.wait(0.1)
                        continue
                    due = heap[0][0]
                    delay = due - time.perf_counter()
                    if delay > 0:
                        self._cond.wait(min(delay, 0.1))
                        continue
                    _, _, it = heapq.heappop(heap)
                    prompt = history[it.user] + it.new_tokens if turns > 1 else self.prefix + it.new_tokens
                if sem is not None:
                    while not sem.acquire(timeout=0.1) and not self._stop.is_set():
                        pass
                    if self._stop.is_set():
                        break
                rid = (f"L{self.run_id}-u{it.user}t{it.turn}" if turns > 1 else f"L{self.run_id}-{it.index:03d}")
                try:
                    stream = self.loop.submit(prompt, self._params(it.max_tokens), request_id=rid)
                except Exception as e:
                    if sem is not None:
                        sem.release()
                    with self._lock:
                        self._submitted += 1
                    finish_one(it, None, f"{type(e).__name__}: {e}")
                    continue
                with self._lock:
                    self._submitted += 1
                    self._streams[rid] = stream
                pool.submit(wait_for, it, rid, stream)
        except Exception as e:
            log.exception("load runner failed")
            self.errors.append(f"runner: {type(e).__name__}: {e}")
        finally:
            if self._stop.is_set():
                self.stop()   # cancel anything submitted after the first stop() sweep
            pool.shutdown(wait=True)
            with self._lock:
                self._t_end = time.perf_counter()
            self._done.set()


def format_progress(p: dict) -> str:
    """A one-line human progress string."""
    state = "stopped" if p["stopped"] and p["done"] else ("done" if p["done"] else "running")
    return (f"{p['name']}: {state} — {p['finished']}/{p['total']} finished, {p['in_flight']} in flight, "
            f"{p['failed']} failed/cancelled, {p['elapsed_s']:.1f} s")
