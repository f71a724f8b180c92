"""EngineLoop: runs an LLMEngine on a background thread; thread-safe submit / stream / cancel.

The loop thread owns the engine. Other threads validate and enqueue requests (`submit`, `submit_many`)
without ever waiting for an engine step: the inbox has its own short lock, and the loop admits whatever
arrived at the start of its next step. Each request's outputs go to its own `RequestStream`, iterable
synchronously or with `async for`; outputs bound for asyncio consumers are handed over once per step and
event loop (one `call_soon_threadsafe` for the whole batch, not one per request).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from typing import Iterator

from engine.config import EngineConfig
from engine.core.sequence import Sequence
from engine.runtime.llm_engine import EngineOverloaded, LLMEngine, RequestFailed
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_END = object()


def _put_many(items: list) -> None:
    """On an asyncio loop: hand one step's items to their sinks (asyncio.Queue-like `put_nowait`)."""
    for sink, item in items:
        sink.put_nowait(item)


class RequestStream:
    """One request's outputs, in order; any number of sync iterators and asyncio subscribers."""

    def __init__(self, loop: "EngineLoop", request_id: str):
        self.loop = loop
        self.request_id = request_id
        self._mu = threading.Condition(threading.Lock())
        self._items: list = []                 # what arrived so far, for readers that come later
        self._keep = True                      # False once subscribed: items go to the subscribers alone
        self._iterating = 0                    # sync iterators reading _items by index
        self._sinks: list[tuple[asyncio.AbstractEventLoop, object]] = []
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    # called on the engine thread
    def _put(self, item, batches: dict | None = None) -> None:
        """Deliver `item`. With `batches` ({event loop: [(sink, item)]}) asyncio hand-overs are collected for
        the caller to flush once per step; without, each is scheduled at once."""
        if isinstance(item, RequestOutput) and item.finished:
            self.final = item
        if isinstance(item, BaseException):
            self.error = item
        with self._mu:
            if self._keep:
                self._items.append(item)
                self._mu.notify_all()
            sinks = list(self._sinks)
        for aloop, sink in sinks:
            if batches is not None:
                batches.setdefault(aloop, []).append((sink, item))
            else:
                _call_soon(aloop, _put_many, [(sink, item)])
        if item is _END:
            self._done.set()

    def subscribe(self, aloop: asyncio.AbstractEventLoop, sink) -> list:
        """Follow this stream on `aloop`: returns what already arrived; later items go to
        `sink.put_nowait(item)` on that loop (the end marker is an object that is not a RequestOutput).

        From then on the stream keeps no history (unless a sync iterator is reading it): a server's stream
        would otherwise hold every output of its request until the request ends, hundreds of thousands of
        objects in a burst, and each full garbage collection would walk them all while no stream is served.
        A later subscriber gets only the items after it subscribed."""
        with self._mu:
            self._sinks.append((aloop, sink))
            items = self._items
            if not self._iterating:
                self._keep = False
                self._items = []
            return list(items)

    def __iter__(self) -> Iterator[RequestOutput]:
        with self._mu:
            if not self._keep:
                raise RuntimeError(f"request {self.request_id}: its stream is followed by a subscriber and keeps "
                                   "no history to iterate")
            self._iterating += 1
        try:
            i = 0
            while True:
                with self._mu:
                    while i >= len(self._items):
                        self._mu.wait()
                    item = self._items[i]
                i += 1
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            with self._mu:
                self._iterating -= 1

    async def __aiter__(self):
        aq: asyncio.Queue = asyncio.Queue()
        for item in self.subscribe(asyncio.get_running_loop(), aq):
            aq.put_nowait(item)
        while True:
            item = await aq.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        self.loop.abort(self.request_id)

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> RequestOutput:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.final is not None
        return self.final


def admit_batch(seqs: list, request_ids: list, taken: dict, limit: int | None, queued: int, next_id) -> None:
    """Under the caller's lock: refuse a batch that would overfill the waiting queue (EngineOverloaded),
    name the unnamed requests (`next_id()`), refuse ids already in use or repeated (ValueError)."""
    if limit is not None and len(seqs) > limit:          # no wait could help: a ValueError, not an overload
        raise ValueError(f"max_waiting_requests: {len(seqs)} requests submitted together can never fit the "
                         f"waiting queue (it holds at most {limit})")
    if limit is not None and queued + len(seqs) > limit:
        raise EngineOverloaded(f"max_waiting_requests: the waiting queue is full ({limit} requests; "
                               f"{queued} queued, {len(seqs)} new)")
    for seq, rid in zip(seqs, request_ids):
        if rid is None:
            seq.request_id = next_id()
    ids = [s.request_id for s in seqs]
    dup = next((r for r in ids if r in taken or ids.count(r) > 1), None)
    if dup is not None:
        raise ValueError(f"request_id: {dup!r} is already in use")


def _call_soon(aloop: asyncio.AbstractEventLoop, fn, arg) -> None:
    try:
        aloop.call_soon_threadsafe(fn, arg)
    except RuntimeError:        # that event loop is closed: its readers are gone
        pass


class EngineLoop:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **overrides):
        self.engine = engine if engine is not None else LLMEngine(config, **overrides)
        # Two locks. `_lock` guards engine state: the loop thread holds it for a whole step, and readers
        # (stats, kv_snapshot, call) take it between steps. `_inbox_lock` guards the inbox and the stream
        # registry and is only ever held for a few list operations, so submitting never waits for a step.
        self._lock = threading.RLock()
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: deque = deque()            # ("add", seq) | ("abort", rid) | ("call", (fn, box, done))
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count(1)
        self._pending_admissions = 0            # submitted, not yet in the engine's waiting queue
        self.error: BaseException | None = None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def engines(self) -> list[LLMEngine]:
        """The engines this loop steps: its one (DPEngineLoop: each replica's)."""
        return [self.engine]

    def _next_id(self) -> str:
        return f"loop-{next(self._ids)}"

    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)
            self._thread.start()
        return self

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Validate (raises ValueError / EngineOverloaded at once) and queue a request. `arrival_time`
        (time.perf_counter()) is when the caller received it; default: now, before tokenization."""
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        return self.submit_many([(prompt, params, request_id)], arrival)[0]

    def submit_many(self, requests: list[tuple], arrival_time: float | None = None) -> list[RequestStream]:
        """Queue several (prompt, params, request_id or None) at once, all or none: every one is validated
        (and tokenized) first, then the capacity check and the enqueue are one critical section."""
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        if self._stop:
            raise RuntimeError("engine loop is shut down")
        seqs = [self.engine.make_sequence(p, sp, rid if rid is not None else "pending", arrival)
                for p, sp, rid in requests]
        return self.submit_sequences(seqs, [rid for _, _, rid in requests])

    def submit_sequences(self, seqs: list[Sequence], request_ids: list[str | None]) -> list[RequestStream]:
        """Queue validated sequences (make_sequence, here or by a data-parallel router), all or none;
        request_ids: the caller's ids, None where the loop names the request."""
        limit = self.engine.config.scheduler_config.max_waiting_requests
        streams = []
        with self._inbox_lock:
            if self._stop:
                raise RuntimeError("engine loop is shut down")
            admit_batch(seqs, request_ids, self._streams, limit,
                        len(self.engine.scheduler.waiting) + self._pending_admissions, self._next_id)
            for seq in seqs:
                stream = RequestStream(self, seq.request_id)
                self._streams[seq.request_id] = stream
                self._inbox.append(("add", seq))
                streams.append(stream)
            self._pending_admissions += len(seqs)
            self.engine.arrivals_pending = True       # no new multi-step block queued ahead of them
        self._wake.set()
        return streams

    def generate(self, prompt, params: SamplingParams | None = None, timeout: float | None = None) -> RequestOutput:
        return self.submit(prompt, params).result(timeout)

    def abort(self, request_id: str) -> None:
        with self._inbox_lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def call(self, fn, timeout: float | None = 30.0):
        """Run fn(engine) on the engine thread between steps and return its result."""
        box: dict = {}
        done = threading.Event()
        with self._inbox_lock:
            self._inbox.append(("call", (fn, box, done)))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError("engine call timed out")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def stats(self) -> dict:
        """metrics_snapshot() taken between steps (consistent with the block tables and queues)."""
        with self._lock:
            return self.metrics_snapshot()

    def metrics_snapshot(self) -> dict:
        """engine.stats() without waiting for the step in progress (plain reads of ints and lengths): what
        /metrics reports, so a scrape never waits on the engine."""
        s = self.engine.stats()             # waiting first: a request leaves pending before it enters waiting
        s["num_waiting"] += self._pending_admissions
        return s

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet finished (a data-parallel router's load)."""
        return len(self._streams)

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def kv_snapshot(self) -> dict:
        with self._lock:
            return self.engine.kv_snapshot()

    def profile_step(self, timeout: float = 60.0) -> list[dict] | None:
        """Profile the next step that runs (needs load) and return its per-kernel table."""
        self.call(lambda e: e.profile_step(), timeout)
        t_end = time.time() + timeout
        while self.engine.profile_pending and time.time() < t_end:
            time.sleep(0.05)
        return self.engine.last_profile

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._inbox_lock:
            self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.stop_workers()              # tensor-parallel worker processes go with the loop
        with self._inbox_lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream._put(RuntimeError("engine shut down"))
            stream._put(_END)

    # ---- the loop thread -----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            items = list(self._inbox)
            self._inbox.clear()
            self.engine.arrivals_pending = False
        for kind, arg in items:
            if kind == "add":
                # out of the pending count before it enters the waiting queue: a stats read (waiting, then
                # pending) may miss it for that instant but never counts it twice
                with self._inbox_lock:
                    self._pending_admissions -= 1
                try:
                    self.engine.add_sequence(arg)
                except Exception as e:  # overloaded or duplicate: tell the one caller, keep serving
                    self._close(arg.request_id, e)
            elif kind == "abort":
                out = self.engine.abort_request(arg)
                if out is not None:
                    self._deliver([out])
            elif kind == "call":
                fn, box, done = arg
                try:
                    box["result"] = fn(self.engine)
                except Exception as e:
                    box["error"] = e
                done.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict = {}
        ended = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out, batches)
            if out.finished:
                stream._put(_END, batches)
                ended.append(out.request_id)
        if ended:
            with self._inbox_lock:
                for rid in ended:
                    self._streams.pop(rid, None)
        for aloop, items in batches.items():
            _call_soon(aloop, _put_many, items)

    def _close(self, request_id: str, err: BaseException) -> None:
        with self._inbox_lock:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(err)
            stream._put(_END)

    def _run(self) -> None:
        while not self._stop:
            if not self._inbox and not self.engine.has_unfinished_requests():
                self._wake.wait(0.5)
                self._wake.clear()              # anything queued before this is seen by the check above
                continue
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    failed = self.engine.pop_failed()
            except Exception as e:  # the engine could not isolate the cause: fail every request, go on
                log.exception("engine step failed")
                self.error = e
                with self._lock:
                    for rid in list(self.engine.seqs):
                        self.engine.abort_request(rid)
                        self._close(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            if failed:                  # requests whose rows made a step raise (the engine ran the others)
                for rid, why in failed.items():
                    self._close(rid, RequestFailed(f"engine step failed for this request: {why}"))
                outputs = [o for o in outputs if o.request_id not in failed]
            self._deliver(outputs)
        for rid in list(self.engine.seqs):
            self.engine.abort_request(rid)
