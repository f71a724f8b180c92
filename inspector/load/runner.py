"""`LoadRunner`: simulated users driving an `EngineLoop` in-process (arrival schedule, concurrency limit,
multi-turn conversations, cancellation), and a one-line progress string."""
from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from inspector import metrics as M
from inspector.load.presets import EngineInfo
from inspector.load.spec import LoadSpec
from inspector.load.text import can_template
from inspector.load.workload import LoadItem, build_workload
from inspector.recorder import RequestRecord

log = logging.getLogger(__name__)

_run_ids = itertools.count(1)


class RunState:
    """What both load runners (in-process and HTTP) share: counters under one lock, start/end stamps,
    stop/done events, and the progress report polled from any thread."""

    def _init_state(self) -> None:
        self.records: list[RequestRecord] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._done = threading.Event()
        self._submitted = self._finished = self._failed = 0
        self._t_start: float | None = None
        self._t_end: float | None = None
        self._thread: threading.Thread | None = None
        self._summary: dict | None = None

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

    def items_by_user(self) -> dict[int, list[LoadItem]]:
        """The workload per simulated user, turns in order (multi-turn chats resend each user's history)."""
        by_user: dict[int, list[LoadItem]] = {}
        for it in self.items:
            by_user.setdefault(it.user, []).append(it)
        return by_user

    def summary(self) -> dict:
        """The run's metrics (metrics.summarize) and counts; frozen once the run is done."""
        if self._summary is not None:
            return self._summary
        with self._lock:
            recs = list(self.records)
        s = M.summarize(recs, slo=self.slo)
        s.update(num_requests=len(self.items), failed=self._failed, not_sent=len(self.items) - self._submitted,
                 stopped=self._stop.is_set(), **self._summary_extra())
        if self._done.is_set():
            self._summary = s
        return s

    def _summary_extra(self) -> dict:
        return {}


class LoadRunner(RunState):
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
        tok = getattr(getattr(loop, "engine", None), "tokenizer", None)
        if spec.prompt_source == "text" and not can_template(tok):
            raise ValueError("prompts: 'text' needs a model with a chat template; this one has none (use random ids)")
        if special_ids is None:
            special_ids = list(getattr(tok, "all_special_ids", []) or [])
        self.special_ids = special_ids
        spec.validate(self.max_model_len)
        self._sampling_factory = sampling_factory
        self.prefix, self.items = build_workload(spec, self.vocab_size, self.special_ids, tok)
        self._init_state()
        self._cond = threading.Condition(self._lock)
        self._streams: dict[str, Any] = {}

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

    # ------------------------------------------------------------------ internals
    def _params(self, max_tokens: int):
        # priority stays 0: under scheduling_policy="priority" a Playground turn (-1) goes ahead of these
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
        by_user = self.items_by_user()
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
