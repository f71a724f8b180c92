"""EngineLoop: runs an LLMEngine on a background thread; thread-safe submit / stream / cancel.

The loop thread owns the engine. Other threads validate and enqueue requests (`submit`), which the loop
admits between steps; each request's outputs go to its own `RequestStream`, iterable synchronously or
with `async for`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Iterator

from .config import EngineConfig
from .llm_engine import EngineOverloaded, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)
_END = object()


class RequestStream:
    def __init__(self, loop: "EngineLoop", request_id: str):
        self.loop = loop
        self.request_id = request_id
        self._q: queue.Queue = queue.Queue()
        self._aio: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self.final: RequestOutput | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()

    # called on the engine thread
    def _put(self, item) -> None:
        if isinstance(item, RequestOutput) and item.finished:
            self.final = item
        if isinstance(item, BaseException):
            self.error = item
        self._q.put(item)
        for aloop, aq in self._aio:
            aloop.call_soon_threadsafe(aq.put_nowait, item)
        if item is _END:
            self._done.set()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aiter__(self):
        aq: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        # replay what already arrived, then follow live
        with self.loop._lock:
            pending = list(self._q.queue)
            self._aio.append((aloop, aq))
        for item in pending:
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


class EngineLoop:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None, **overrides):
        self.engine = engine if engine is not None else LLMEngine(config, **overrides)
        self._lock = threading.RLock()          # guards the inbox and engine state reads
        self._wake = threading.Condition(self._lock)
        self._inbox: list = []                  # ("add", seq, stream) | ("abort", rid)
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = 0
        self._pending_admissions = 0
        self.error: BaseException | None = None

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

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
               request_id: str | None = None) -> RequestStream:
        """Validate (raises ValueError / EngineOverloaded at once) and queue a request."""
        if self._stop:
            raise RuntimeError("engine loop is shut down")
        with self._lock:
            if request_id is None:
                self._ids += 1
                request_id = f"loop-{self._ids}"
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            limit = self.engine.config.max_waiting_requests
            if limit is not None and len(self.engine.scheduler.waiting) + self._pending_admissions >= limit:
                raise EngineOverloaded(f"max_waiting_requests: the waiting queue is full ({limit} requests)")
        seq = self.engine.make_sequence(prompt, params, request_id)
        stream = RequestStream(self, request_id)
        with self._lock:
            self._streams[request_id] = stream
            self._inbox.append(("add", seq))
            self._pending_admissions += 1
            self._wake.notify()
        return stream

    def generate(self, prompt, params: SamplingParams | None = None, timeout: float | None = None) -> RequestOutput:
        return self.submit(prompt, params).result(timeout)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
            self._wake.notify()

    def call(self, fn, timeout: float | None = 30.0):
        """Run fn(engine) on the engine thread between steps and return its result."""
        box: dict = {}
        done = threading.Event()
        with self._lock:
            self._inbox.append(("call", (fn, box, done)))
            self._wake.notify()
        if not done.wait(timeout):
            raise TimeoutError("engine call timed out")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def stats(self) -> dict:
        with self._lock:
            s = self.engine.stats()
            s["num_waiting"] += self._pending_admissions
            return s

    def kv_snapshot(self) -> dict:
        with self._lock:
            return self.engine.kv_snapshot()

    def profile_step(self, timeout: float = 60.0) -> list[dict] | None:
        """Profile the next step that runs (needs load) and return its per-kernel table."""
        self.call(lambda e: e.profile_step(), timeout)
        import time
        t_end = time.time() + timeout
        while self.engine._profile_next and time.time() < t_end:
            time.sleep(0.05)
        return self.engine.last_profile

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for stream in list(self._streams.values()):
            stream._put(RuntimeError("engine shut down"))
            stream._put(_END)
        self._streams.clear()

    # ---- the loop thread -----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._lock:
            items, self._inbox = self._inbox, []
        for kind, arg in items:
            if kind == "add":
                with self._lock:
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
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream._put(out)
            if out.finished:
                stream._put(_END)
                with self._lock:
                    self._streams.pop(out.request_id, None)

    def _close(self, request_id: str, err: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(err)
            stream._put(_END)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._inbox and not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                if self._stop:
                    break
            self._drain_inbox()
            if not self.engine.has_unfinished_requests():
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
            except Exception as e:  # a failing step must not strand callers: fail its requests, go on
                log.exception("engine step failed")
                self.error = e
                for rid in list(self.engine.seqs):
                    self.engine.abort_request(rid)
                    self._close(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            self._deliver(outputs)
        for rid in list(self.engine.seqs):
            self.engine.abort_request(rid)
