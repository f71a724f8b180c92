"""The engine requests behind one HTTP request, followed on the event loop, and their SSE response.

Outputs reach the event loop through `RequestStream.subscribe` (one `call_soon_threadsafe` per engine step
for all of them), so the event loop never waits on the engine loop's lock. A choice's outputs that are already
queued when its reader comes for the next one are merged into one (`merge_outputs`), as vLLM's output collector
does: a response that falls behind the engine sends fewer, fuller chunks instead of a backlog of small ones.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections import deque
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from engine.runtime.async_engine import EngineLoop
from engine.runtime.core_client import EngineDied
from engine.runtime.llm_engine import EngineOverloaded
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

from engine.entrypoints.openai.errors import APIError, engine_stopped, request_timeout

log = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"
_TIMEOUT = object()          # the job's deadline passed (put in its queue by a timer)
PERIOD_EWMA = 0.25           # weight of a choice's latest gap between outputs in its mean (Job.hold_back)


async def sse_stream(job: "Job", req, rid: str, obj: str, choices: AsyncIterator[tuple[dict | None, int]],
                     first: dict | None = None) -> AsyncIterator[str]:
    """The framing both streaming endpoints share: `choices` yields (choice or None, tokens generated so far);
    each choice becomes one chunk (with running usage under `continuous_usage_stats`), then the final usage
    chunk when `stream_options.include_usage`, an error object if the request failed, and `[DONE]`.
    first: top-level fields of the first chunk only (chat's `prompt_token_ids`, as vLLM sends it)."""
    from engine.entrypoints.openai.protocol import usage_dict
    head = {"id": rid, "object": obj, "created": int(time.time()), "model": job.model_name}
    gen = 0
    try:
        async for choice, gen in choices:
            if choice is None:
                continue
            chunk = {**head, **(first or {}), "choices": [choice]}
            first = None
            if req.include_usage:
                chunk["usage"] = usage_dict(job.prompt_tokens(), gen) if req.continuous_usage else None
            yield sse(chunk)
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage_dict(job.prompt_tokens(), gen, job.cached_tokens())})
    except APIError as e:
        job.abort_unfinished()
        yield sse(e.body())
    yield SSE_DONE


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Tag:
    """A RequestStream sink feeding the job's one queue: tags each item with its choice index."""

    def __init__(self, q: asyncio.Queue, index: int):
        self.q = q
        self.index = index

    def put_nowait(self, item) -> None:
        self.q.put_nowait((self.index, item))


class Job:
    """The engine requests behind one HTTP request (n choices x prompts), followed on the event loop."""

    # `server`: the OpenAIServing that made the job (not imported: serving_engine imports this module)
    def __init__(self, server: Any, loop: EngineLoop, rids: list[str], streams: list,
                 prompt_ids: list[list[int]], prompt_of: list[int], params: list[SamplingParams]):
        self.server = server
        self.loop = loop
        self.model_name = server.model_name_of(loop)
        self.rids = rids
        self.streams = streams
        self.prompt_ids = prompt_ids      # one per prompt
        self.prompt_of = prompt_of        # choice index -> prompt index
        self.params = params
        self.finals: list = [None] * len(streams)
        self.closed = [False] * len(streams)
        self.first_sent: list[float | None] = [None] * len(streams)   # first token handed to the response
        self.last_sent: list[float] = [0.0] * len(streams)                # and the latest chunk
        self.n = 1                        # choices per prompt, and the client's trace context (for traces)
        self.trace_headers: dict | None = None
        self._q: asyncio.Queue | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._backlog: deque = deque()
        self._held: list[list[RequestOutput]] = [[] for _ in streams]   # per choice, under stream_interval
        self._arrived: list[float | None] = [None] * len(streams)       # per choice, its latest output's arrival
        self._period: list[float | None] = [None] * len(streams)        # and the mean gap between them (EWMA)
        self._tasks: list[asyncio.Task] = []

    def attach(self) -> None:
        """Follow the streams on this event loop: each delivers what already arrived, then hands later
        items over once per engine step (`RequestStream.subscribe`)."""
        aloop = asyncio.get_running_loop()
        self._q = asyncio.Queue()
        if self.server.request_timeout:         # one timer per job, not a timeout per awaited item
            self._timer = aloop.call_later(self.server.request_timeout, self._q.put_nowait, (-1, _TIMEOUT))
        for i, s in enumerate(self.streams):
            if hasattr(s, "subscribe"):
                self._backlog.extend((i, x) for x in s.subscribe(aloop, _Tag(self._q, i)))
            else:                          # any other stream type: its own async iterator
                self._tasks.append(asyncio.create_task(self._pump(i, s)))

    async def _pump(self, i: int, s) -> None:
        try:
            async for out in s:
                self._q.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self._q.put_nowait((i, e))

    async def _next(self):
        if not self._backlog:
            self._backlog.append(await self._q.get())
        while not self._q.empty():                 # whatever else already arrived, to merge below
            self._backlog.append(self._q.get_nowait())
        i, x = item = self._backlog.popleft()
        if x is _TIMEOUT:
            raise request_timeout(self.server.request_timeout)
        if not isinstance(x, RequestOutput) or x.finished:
            return item
        later = [x]                                # this choice's next outputs queued behind x, up to its last
        for j, y in self._backlog:
            if j != i:
                continue
            if not isinstance(y, RequestOutput):
                break
            later.append(y)
            if y.finished:
                break
        if len(later) == 1:
            return item
        merged = set(map(id, later[1:]))
        self._backlog = deque(e for e in self._backlog if id(e[1]) not in merged)
        return i, merge_outputs(later)

    def hold_back(self, i: int, x: RequestOutput, now: float | None = None) -> RequestOutput | None:
        """Under the server's stream_interval N > 1, choice i's output x waits with those held before it until
        together they carry N new tokens, and under stream_interval_ms T > 0 until T has passed since the choice's
        last chunk (now: perf_counter seconds; T: `OpenAIServing.stream_wait_s`); the first output with tokens and
        the last one leave at once (held ones merged in), as vLLM's output processor does. Returns what to send now,
        or None.

        Under "auto" a chunk holds whole engine outputs (a step's, or a decode block's): k = ceil(T / p) of them,
        p the choice's mean gap between outputs, or fewer once (k - 1/2) p have passed (a long step: a prefill
        among the decodes). A wait measured in time alone lets a chunk go after one output or after two as the
        outputs' gaps jitter around T, and the client sees the uneven gaps."""
        held = self._held[i]
        srv = self.server
        if srv.stream_interval_ms:
            now = time.perf_counter() if now is None else now
            if srv.stream_interval_ms == "auto":
                self._observe_gap(i, now)
        if (srv.stream_interval > 1 or srv.stream_interval_ms) and not x.finished and self.first_sent[i] is not None:
            held.append(x)
            if sum(len(o.delta_token_ids) for o in held) < srv.stream_interval or \
                    (srv.stream_interval_ms and not self._wait_over(i, len(held), now)):
                return None
        elif held:
            held.append(x)
        else:
            return x
        self._held[i] = []
        return merge_outputs(held)

    def _observe_gap(self, i: int, now: float) -> None:
        """Choice i's output arrived at `now`: its mean gap between outputs, where a long step (a prefill among the
        decodes) moves the mean by one period at most."""
        prev, self._arrived[i] = self._arrived[i], now
        if prev is not None:
            p = self._period[i]
            self._period[i] = now - prev if p is None else p + PERIOD_EWMA * (min(now - prev, 2 * p) - p)

    def _wait_over(self, i: int, held: int, now: float) -> bool:
        """Whether choice i's chunk of `held` outputs has waited stream_interval_ms (hold_back)."""
        wait, elapsed, p = self.server.stream_wait_s(), now - self.last_sent[i], self._period[i]
        if self.server.stream_interval_ms != "auto" or not p:
            return elapsed >= wait
        k = max(1, math.ceil(wait / p))
        return held >= k or elapsed >= (k - 0.5) * p

    async def outputs(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, RequestOutput) in arrival order until every choice finished."""
        while not all(self.closed):
            i, x = await self._next()
            if self.closed[i]:
                continue
            if isinstance(x, BaseException):
                self.closed[i] = True
                if isinstance(x, EngineOverloaded):
                    raise self.server.overloaded(self.loop, str(x))
                # the engine was shut down / rebuilt under us, or its process died (and is restarting): 503
                if getattr(self.loop, "_stop", False) or isinstance(x, EngineDied):
                    raise engine_stopped(x, self.server.retry_after_s)
                raise APIError(f"engine error: {x}", 500, "server_error", code="engine_error")
            if not hasattr(x, "finished"):    # the end-of-stream marker
                continue
            x = self.hold_back(i, x)
            if x is None:
                continue
            first = self.first_sent[i] is None and bool(x.delta_token_ids)
            if x.finished:
                self.closed[i] = True
                self.finals[i] = x
            try:
                yield i, x
            finally:
                # The consumer asks for the next output once it has handed this one on (a streamed chunk: to
                # the HTTP transport), so /metrics' first-token and end stamps are taken here.
                now = self.last_sent[i] = time.perf_counter()
                if first:
                    self.first_sent[i] = now
                if x.finished:
                    self.server.metrics.observe(x, self.model_name, self.first_sent[i], now)
                    if self.server.tracer is not None:
                        self.server.tracer.trace(x, self.model_name, self.params[i], self.n, self.trace_headers,
                                                 now)

    def abort_unfinished(self) -> None:
        """Abort every choice still running (no await: safe from finally blocks and cancelled scopes)."""
        if self._timer is not None:
            self._timer.cancel()
        for t in self._tasks:
            t.cancel()
        todo = [rid for rid, c in zip(self.rids, self.closed) if not c]
        if not todo:
            return
        for i, c in enumerate(self.closed):
            self.closed[i] = True
        self.server.metrics.count_aborted(self.model_name, len(todo))
        loop = self.loop

        def abort():
            for rid in todo:
                try:
                    loop.abort(rid)
                except Exception:  # noqa: BLE001
                    log.exception("abort of %s failed", rid)
        try:
            asyncio.get_running_loop().run_in_executor(None, abort)
        except RuntimeError:       # no running event loop (interpreter shutting down)
            abort()

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_ids)

    def cached_tokens(self) -> int:
        seen, total = set(), 0
        for i, f in enumerate(self.finals):
            p = self.prompt_of[i]
            if f is not None and p not in seen:
                seen.add(p)
                total += f.num_cached_tokens
        return total


class SSEResponse(StreamingResponse):
    """A StreamingResponse that aborts the job's unfinished requests however the stream ends."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope, receive, send):
        server, n = self._job.server, len(self._job.streams)
        server.open_streams += n
        try:
            await super().__call__(scope, receive, send)
        finally:
            server.open_streams -= n
            self._job.abort_unfinished()


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request -> one: the last one's state with every delta joined."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    return dataclasses.replace(last, delta_text="".join(o.delta_text for o in outs),
                               delta_token_ids=[t for o in outs for t in o.delta_token_ids])


def stream_choice(index: int, out, logprobs, new_token_ids: list[int], return_token_ids: bool, **content) -> dict:
    """One streamed choice: its content (`delta` or `text`), logprobs, finish_reason (stop_reason on the last
    chunk) and, when asked, the chunk's token ids."""
    choice = {"index": index, **content, "logprobs": logprobs,
              "finish_reason": out.finish_reason if out.finished else None}
    if out.finished:
        choice["stop_reason"] = out.stop_reason
    if return_token_ids:
        choice["token_ids"] = new_token_ids
    return choice
