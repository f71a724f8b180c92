"""OpenAI-compatible HTTP server over an EngineLoop (FastAPI + Server-Sent Events).

    python -m engine.entrypoints.openai.api_server --host 127.0.0.1 --port 8000 --model dummy:tiny

Routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (streaming or not),
`GET /health`, `GET /metrics` (Prometheus text format).

- `build_app(loop, api_key=None, ...)` returns a FastAPI app serving one EngineLoop.
- `register(app, get_loop, api_key=None, ...)` adds the same routes to an existing FastAPI app (app.py
  mounts the Gradio UI beside them with `gr.mount_gradio_app`). `get_loop()` is called per request, so
  the engine behind the API may be rebuilt (new config) while the server runs; while there is none
  the API answers 503.

Faults and limits, all answered with OpenAI-style `{"error": {...}}` bodies:
- 400: malformed JSON, a bad parameter (the error's `param` names it), a prompt that cannot fit.
- 401: `--api-key` set and `Authorization: Bearer <key>` missing or wrong (only `/v1/*` is guarded).
- 404: unknown model name. 413: request body over `max_body_bytes`.
- 503 + `Retry-After`: the engine's waiting queue (`EngineConfig.max_waiting_requests`) is full. A request
  is accepted whole or not at all (all `n` choices of all prompts), so nothing accepted is dropped.
- 504: the request ran past `request_timeout`; it is aborted in the engine (in a stream: an error
  event, then `data: [DONE]`).
- A client that disconnects (mid-stream or while waiting for a non-streamed answer) has its requests
  aborted; the engine loop frees their KV blocks before its next step.

The event loop never waits on the engine: submitting (tokenization, chat template, the loop's lock,
held while a step runs) happens on a worker thread, and outputs reach the event loop through
`call_soon_threadsafe`, so one slow step never stalls other clients' streams.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections import deque
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineLoop
from engine.config import EngineConfig
from engine.llm_engine import EngineOverloaded
from engine.sampling_params import SamplingParams

from .metrics import ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs, completion_logprobs,
                       error_body, usage_dict, validation_error)

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_REQUEST_TIMEOUT_S = 600.0
_PARAM_RE = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][\w.]*):\s*(.*)$", re.S)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


# ------------------------------------------------------------------------------------------ a job
class _Tag:
    """Stands in for an asyncio.Queue in RequestStream._aio: tags each item with its choice index."""

    def __init__(self, q: asyncio.Queue, index: int):
        self.q = q
        self.index = index

    def put_nowait(self, item) -> None:
        self.q.put_nowait((self.index, item))


class _Job:
    """The engine requests behind one HTTP request (n choices x prompts), followed on the event loop."""

    def __init__(self, server: "_Server", loop: EngineLoop, rids: list[str], streams: list,
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
        self.deadline = (time.monotonic() + server.request_timeout) if server.request_timeout else None
        self._q: asyncio.Queue | None = None
        self._backlog: deque = deque()
        self._skip: list[set[int]] = []
        self._tasks: list[asyncio.Task] = []

    # Attach to the streams without taking the engine loop's lock (which is held for a whole step):
    # register our queue first, then snapshot what already arrived; an item that landed in between
    # comes both ways and is dropped once by identity (the stream keeps every item alive).
    def attach(self) -> None:
        aloop = asyncio.get_running_loop()
        self._q = asyncio.Queue()
        for i, s in enumerate(self.streams):
            if hasattr(s, "_aio") and hasattr(s, "_q"):
                s._aio.append((aloop, _Tag(self._q, i)))
                with s._q.mutex:
                    seen = list(s._q.queue)
                self._skip.append({id(x) for x in seen})
                self._backlog.extend((i, x) for x in seen)
            else:                          # any other stream type: its own async iterator
                self._skip.append(set())
                self._tasks.append(asyncio.create_task(self._pump(i, s)))

    async def _pump(self, i: int, s) -> None:
        try:
            async for out in s:
                self._q.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            self._q.put_nowait((i, e))

    async def _next(self):
        if self._backlog:
            return self._backlog.popleft()
        while True:
            if self.deadline is None:
                item = await self._q.get()
            else:
                left = self.deadline - time.monotonic()
                try:
                    item = await asyncio.wait_for(self._q.get(), max(left, 0.0))
                except asyncio.TimeoutError:
                    raise APIError(f"request timed out after {self.server.request_timeout:g} s and was aborted "
                                   "(server request_timeout)", 504, "timeout_error", code="request_timeout")
            i, x = item
            if id(x) in self._skip[i]:
                self._skip[i].discard(id(x))
                continue
            return item

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
                if getattr(self.loop, "_stop", False):     # the engine was shut down / rebuilt under us
                    raise APIError(f"the engine was stopped while serving this request: {x}", 503,
                                   "server_error", code="engine_stopped",
                                   headers={"Retry-After": str(self.server.retry_after_s)})
                raise APIError(f"engine error: {x}", 500, "server_error", code="engine_error")
            if not hasattr(x, "finished"):    # the end-of-stream marker
                continue
            if x.finished:
                self.closed[i] = True
                self.finals[i] = x
                self.server.metrics.observe(x, self.model_name)
            yield i, x

    def abort_unfinished(self) -> None:
        """Abort every choice still running (no await: safe from finally blocks and cancelled scopes)."""
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


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that aborts the job's unfinished requests however the stream ends."""

    def __init__(self, content, job: _Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._job.abort_unfinished()


# ------------------------------------------------------------------------------------------ server
class _Server:
    def __init__(self, get_loop: Callable[[], EngineLoop], api_key: str | None, served_model_name: str | None,
                 request_timeout: float | None, max_body_bytes: int, retry_after_s: int,
                 metrics: ServerMetrics | None):
        self.get_loop = get_loop
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.request_timeout = request_timeout
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.metrics = metrics or ServerMetrics(self._loop_or_none, self.model_name_of)
        self.created = int(time.time())
        self._admit = threading.Lock()     # capacity check + submits of one request, atomically

    # ---- the engine behind the API ------------------------------------------------------------
    def _loop_or_none(self) -> EngineLoop | None:
        try:
            return self.get_loop()
        except Exception:  # noqa: BLE001 - no engine right now (starting, restarting, failed)
            return None

    def current(self) -> EngineLoop:
        try:
            loop = self.get_loop()
        except Exception as e:  # noqa: BLE001
            raise APIError(f"the engine is not available right now ({e}); retry shortly", 503, "server_error",
                           code="engine_unavailable", headers={"Retry-After": str(self.retry_after_s)})
        if loop is None or getattr(loop, "_stop", False):
            raise APIError("the engine is not available right now; retry shortly", 503, "server_error",
                           code="engine_unavailable", headers={"Retry-After": str(self.retry_after_s)})
        return loop

    def model_name_of(self, loop: EngineLoop | None) -> str:
        if self.served_model_name:
            return self.served_model_name
        eng = getattr(loop, "engine", None)
        return str(getattr(eng, "model_name", None) or "kvscope")

    def healthy(self) -> tuple[bool, str]:
        loop = self._loop_or_none()
        if loop is None:
            return False, "no engine (starting, restarting or failed)"
        t = getattr(loop, "_thread", None)
        if t is None or not t.is_alive() or getattr(loop, "_stop", False):
            return False, "the engine loop is not running"
        return True, "ok"

    def overloaded(self, loop: EngineLoop, detail: str) -> APIError:
        limit = loop.engine.config.max_waiting_requests
        return APIError(f"The server is overloaded: the engine's waiting queue is full "
                        f"(max_waiting_requests={limit}); retry after {self.retry_after_s} s. [{detail}]",
                        503, "server_overloaded", code="queue_full",
                        headers={"Retry-After": str(self.retry_after_s)})

    def check_model(self, model: str | None, loop: EngineLoop) -> None:
        name = self.model_name_of(loop)
        if model and model != name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{name}` "
                           "(see GET /v1/models).", 404, "NotFoundError", param="model", code="model_not_found")

    # ---- request parsing ----------------------------------------------------------------------
    async def read_json(self, request: Request, model_cls):
        limit = self.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                declared = int(cl)
            except ValueError:
                raise APIError("Content-Length: must be an integer", code="invalid_header")
            if declared > limit:
                raise APIError(f"request body is {declared} bytes; this server accepts at most {limit} bytes",
                               413, code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(f"request body exceeds {limit} bytes", 413, code="body_too_large")
            chunks.append(chunk)
        body = b"".join(chunks)
        if not body.strip():
            raise APIError("request body: must be a JSON object (got an empty body)", code="invalid_body")
        try:
            return model_cls.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e)

    @staticmethod
    def _value_error(e: ValueError, rename: dict[str, str]) -> APIError:
        msg = str(e)
        m = _PARAM_RE.match(msg)
        if not m:
            return APIError(msg)
        param = rename.get(m.group(1), m.group(1))
        return APIError(f"{param}: {m.group(2)}", param=param, code="invalid_value")

    @staticmethod
    def _sampling(req, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(max_tokens=max_tokens, seed=seed, logprobs=logprobs, stop=list(req.stop or []),
                                  stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)

    # ---- submission (runs on a worker thread: it may tokenize and wait for the loop's lock) -----
    def _submit(self, loop: EngineLoop, prompts: list, req, chat: bool) -> _Job:
        eng = loop.engine
        limit_param = req.limit_param if chat else "max_tokens"
        rename = {"logprobs": "top_logprobs" if chat else "logprobs", "prompt": "messages" if chat else "prompt",
                  "max_tokens": limit_param}
        prompt_ids: list[list[int]] = []
        for p in prompts:
            try:
                ids = eng.tokenize(p) if isinstance(p, str) else list(p)
            except ValueError as e:
                raise self._value_error(e, rename)
            if not ids:
                what = "messages" if chat else "prompt"
                raise APIError(f"{what}: must contain at least one token", param=what)
            prompt_ids.append(ids)
        if chat:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            user_limit = req.output_limit
        else:
            logprobs = req.logprobs
            user_limit = req.max_tokens if req.max_tokens is not None else 16
        mml = eng.max_model_len
        params, prompt_of = [], []
        for pi, ids in enumerate(prompt_ids):
            max_tokens = user_limit
            if max_tokens is None:              # chat without a limit: whatever room the context leaves
                max_tokens = min(mml, (eng.num_blocks - 1) * eng.block_size) - len(ids)
                if max_tokens < 1:
                    raise APIError(f"messages: the conversation is {len(ids)} tokens; it leaves no room for "
                                   f"output in max_model_len {mml}", param="messages",
                                   code="context_length_exceeded")
            elif len(ids) < mml and len(ids) + max_tokens > mml:
                raise APIError(f"{limit_param}: prompt ({len(ids)} tokens) + {limit_param} ({max_tokens}) = "
                               f"{len(ids) + max_tokens} tokens exceeds this model's max_model_len ({mml}); "
                               f"lower {limit_param} or shorten the prompt", param=limit_param,
                               code="context_length_exceeded")
            for k in range(req.n):
                seed = None if req.seed is None else req.seed + k
                try:
                    params.append(self._sampling(req, max_tokens, logprobs, seed))
                except ValueError as e:
                    raise self._value_error(e, rename)
                prompt_of.append(pi)
        # validate every prompt before submitting any (a bad prompt must not leave others running)
        for pi, ids in enumerate(prompt_ids):
            first = prompt_of.index(pi)
            try:
                eng.make_sequence(ids, params[first], request_id="validate")
            except ValueError as e:
                raise self._value_error(e, rename)
        # Accept the whole request or none of it. The capacity check and the submits are one critical
        # section: EngineLoop.submit checks the queue and counts the new request in two separate lock
        # sections, so concurrent submitters could all pass the check and the engine would then refuse
        # the surplus after the 200 (and the stream) had begun.
        limit = eng.config.max_waiting_requests
        if limit is not None:                 # fail fast without queueing behind the lock
            queued = len(eng.scheduler.waiting) + getattr(loop, "_pending_admissions", 0)
            if queued + len(params) > limit:
                raise self.overloaded(loop, f"{queued} queued + {len(params)} new > {limit}")
        base = uuid.uuid4().hex
        rids, streams = [], []
        with self._admit:
            if limit is not None:
                queued = len(eng.scheduler.waiting) + getattr(loop, "_pending_admissions", 0)
                if queued + len(params) > limit:
                    raise self.overloaded(loop, f"{queued} queued + {len(params)} new > {limit}")
            try:
                for i, sp in enumerate(params):
                    rid = f"{base}-{i}"
                    streams.append(loop.submit(prompt_ids[prompt_of[i]], sp, request_id=rid))
                    rids.append(rid)
            except (ValueError, EngineOverloaded, RuntimeError) as e:
                for rid in rids:
                    loop.abort(rid)
                if isinstance(e, EngineOverloaded):
                    raise self.overloaded(loop, str(e))
                if isinstance(e, ValueError):
                    raise self._value_error(e, rename)
                raise APIError(f"the engine is not available right now ({e}); retry shortly", 503,
                               "server_error", code="engine_unavailable",
                               headers={"Retry-After": str(self.retry_after_s)})
        job = _Job(self, loop, rids, streams, prompt_ids, prompt_of, params)
        job.id_base = base
        return job

    async def submit(self, loop: EngineLoop, prompts: list, req, chat: bool) -> _Job:
        job = await run_in_threadpool(self._submit, loop, prompts, req, chat)
        job.attach()
        return job

    async def run_to_end(self, job: _Job, request: Request) -> None:
        """Wait for every choice to finish; abort them if the client goes away or time runs out."""
        async def drain():
            async for _ in job.outputs():
                pass

        async def disconnected():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        consumer = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer in done:
                consumer.result()                 # re-raise timeouts / engine errors
            else:
                consumer.cancel()
                raise APIError("client disconnected", 499, "client_closed_request")
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
            job.abort_unfinished()

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.read_json(request, CompletionRequest)
        req.check_unsupported()
        loop = self.current()
        self.check_model(req.model, loop)
        if req.echo and req.logprobs is not None:
            raise APIError("echo: not supported together with logprobs (no prompt logprobs)", param="echo",
                           code="unsupported")
        job = await self.submit(loop, req.prompt, req, chat=False)
        echo = [self._echo_text(loop, p) for p in req.prompt] if req.echo else None
        if req.stream:
            return _SSEResponse(self._completion_stream(req, job, echo), job)
        await self.run_to_end(job, request)
        choices = []
        for i, out in enumerate(job.finals):
            text = (echo[job.prompt_of[i]] if echo else "") + out.text
            lp = None
            if req.logprobs is not None and out.logprobs is not None:
                lp = completion_logprobs(out.logprobs[:len(out.token_ids)], 0, req.logprobs)
            c = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                 "stop_reason": out.stop_reason}
            if req.return_token_ids:
                c["token_ids"] = list(out.token_ids)
            choices.append(c)
        body = {"id": f"cmpl-{job.id_base}", "object": "text_completion", "created": int(time.time()),
                "model": job.model_name, "choices": choices,
                "usage": usage_dict(job.prompt_tokens(), sum(len(f.token_ids) for f in job.finals),
                                    job.cached_tokens())}
        if req.return_token_ids:
            body["prompt_token_ids"] = job.prompt_ids[0] if len(job.prompt_ids) == 1 else job.prompt_ids
        return JSONResponse(body)

    @staticmethod
    def _echo_text(loop: EngineLoop, p) -> str:
        if isinstance(p, str):
            return p
        tok = loop.engine.tokenizer
        return tok.decode(p, skip_special_tokens=False) if tok is not None else ""

    async def _completion_stream(self, req: CompletionRequest, job: _Job, echo) -> AsyncIterator[str]:
        rid, created, model = f"cmpl-{job.id_base}", int(time.time()), job.model_name
        k = len(job.streams)
        ntok, nchar, started = [0] * k, [0] * k, [False] * k
        gen = 0
        try:
            async for i, out in job.outputs():
                new = list(out.delta_token_ids)
                gen += len(new)
                lp = None
                if req.logprobs is not None and out.logprobs is not None:
                    lp = completion_logprobs(out.logprobs[ntok[i]:ntok[i] + len(new)], nchar[i], req.logprobs)
                ntok[i] += len(new)
                text = out.delta_text
                if echo and not started[i]:
                    text = echo[job.prompt_of[i]] + text
                if not text and not out.finished and lp is None and not (req.return_token_ids and new):
                    continue
                started[i] = True
                nchar[i] += len(out.delta_text)
                choice = {"index": i, "text": text, "logprobs": lp,
                          "finish_reason": out.finish_reason if out.finished else None}
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                if req.return_token_ids:
                    choice["token_ids"] = new
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": [choice]}
                if req.include_usage:
                    chunk["usage"] = usage_dict(job.prompt_tokens(), gen) if req.continuous_usage else None
                yield _sse(chunk)
            if req.include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage_dict(job.prompt_tokens(), gen, job.cached_tokens())})
        except APIError as e:
            job.abort_unfinished()
            yield _sse(e.body())
        yield _DONE

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.read_json(request, ChatCompletionRequest)
        req.check_unsupported()
        loop = self.current()
        self.check_model(req.model, loop)
        try:
            prompt = await run_in_threadpool(loop.engine.apply_chat_template, req.messages,
                                             req.add_generation_prompt)
        except ValueError as e:
            raise self._value_error(e, {})
        except Exception as e:  # noqa: BLE001 - a template that raises on these messages (e.g. role order)
            raise APIError(f"messages: the chat template rejected them: {e}", param="messages")
        job = await self.submit(loop, [prompt], req, chat=True)
        top_n = req.top_logprobs or 0
        if req.stream:
            return _SSEResponse(self._chat_stream(req, job, top_n), job)
        await self.run_to_end(job, request)
        choices = []
        for i, out in enumerate(job.finals):
            lp = None
            if req.logprobs and out.logprobs is not None:
                lp = chat_logprobs(out.logprobs[:len(out.token_ids)], top_n)
            c = {"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                 "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            if req.return_token_ids:
                c["token_ids"] = list(out.token_ids)
            choices.append(c)
        body = {"id": f"chatcmpl-{job.id_base}", "object": "chat.completion", "created": int(time.time()),
                "model": job.model_name, "choices": choices,
                "usage": usage_dict(job.prompt_tokens(), sum(len(f.token_ids) for f in job.finals),
                                    job.cached_tokens())}
        if req.return_token_ids:
            body["prompt_token_ids"] = job.prompt_ids[0]
        return JSONResponse(body)

    async def _chat_stream(self, req: ChatCompletionRequest, job: _Job, top_n: int) -> AsyncIterator[str]:
        rid, created, model = f"chatcmpl-{job.id_base}", int(time.time()), job.model_name
        k = len(job.streams)
        ntok, started = [0] * k, [False] * k
        gen = 0
        try:
            async for i, out in job.outputs():
                new = list(out.delta_token_ids)
                gen += len(new)
                lp = None
                if req.logprobs and out.logprobs is not None:
                    lp = chat_logprobs(out.logprobs[ntok[i]:ntok[i] + len(new)], top_n)
                ntok[i] += len(new)
                if not out.delta_text and not out.finished and lp is None and started[i] \
                        and not (req.return_token_ids and new):
                    continue
                delta: dict[str, Any] = {}
                if not started[i]:
                    delta["role"] = "assistant"
                    started[i] = True
                if out.delta_text or "role" in delta:
                    delta["content"] = out.delta_text
                choice = {"index": i, "delta": delta, "logprobs": lp,
                          "finish_reason": out.finish_reason if out.finished else None}
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                if req.return_token_ids:
                    choice["token_ids"] = new
                chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": [choice]}
                if req.include_usage:
                    chunk["usage"] = usage_dict(job.prompt_tokens(), gen) if req.continuous_usage else None
                yield _sse(chunk)
            if req.include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": usage_dict(job.prompt_tokens(), gen, job.cached_tokens())})
        except APIError as e:
            job.abort_unfinished()
            yield _sse(e.body())
        yield _DONE

    # ---- /v1/models ---------------------------------------------------------------------------
    def models(self) -> dict:
        loop = self.current()
        eng = loop.engine
        name = self.model_name_of(loop)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "kvscope",
            "root": str(eng.config.model or name), "parent": None, "max_model_len": eng.max_model_len,
            "vocab_size": int(getattr(getattr(eng, "model_config", None), "vocab_size", 0) or 0)}]}


class _ApiMiddleware:
    """Guards /v1/* with the API key (when set) and counts API responses by endpoint and status.
    Pure ASGI (no BaseHTTPMiddleware), so streaming and disconnects pass through untouched; paths outside
    /v1 (e.g. a mounted Gradio UI) are not touched at all."""

    def __init__(self, app, server: _Server):
        self.app = app
        self.server = server
        self._key = server.api_key.encode() if server.api_key else None

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        status = 500

        async def send_(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            if self._key is not None and not self._authorized(scope):
                resp = JSONResponse(error_body("Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                               "authentication_error", None, "invalid_api_key"),
                                    401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send_)
                return
            await self.app(scope, receive, send_)
        finally:
            self.server.metrics.count_api(scope["path"], status)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), e.status, headers=e.headers)


def _guarded(handler):
    """Route wrapper: APIError -> its OpenAI-style response; anything else -> a logged 500. Kept per route
    (not app-wide exception handlers) so an app shared with the Gradio UI keeps its own error pages."""
    async def route(request: Request):
        try:
            return await handler(request)
        except APIError as e:
            return _error_response(e)
        except Exception as e:  # noqa: BLE001
            log.exception("unhandled error on %s", request.url.path)
            return JSONResponse(error_body(f"internal server error: {type(e).__name__}: {e}", "server_error",
                                           None, 500), 500)
    route.__name__ = handler.__name__
    return route


def register(app: FastAPI, get_loop: Callable[[], EngineLoop], api_key: str | None = None, *,
             served_model_name: str | None = None, request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, retry_after_s: int = 1,
             metrics: ServerMetrics | None = None) -> "_Server":
    """Add the API's routes (/v1/*, /health, /metrics) and its /v1 middleware to `app`.

    get_loop: returns the EngineLoop to serve, called per request (raise or return None while there is
    none: the API answers 503). api_key: required as `Authorization: Bearer <key>` on /v1/* when set.
    request_timeout: seconds per request (None: no limit). max_body_bytes: larger bodies get 413.
    retry_after_s: the Retry-After of 503s. metrics: a ServerMetrics to share (default: a new registry).
    Call before mounting anything at "/" so these routes take precedence."""
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError(f"request_timeout: must be > 0 seconds or None (got {request_timeout!r})")
    if not (isinstance(max_body_bytes, int) and max_body_bytes >= 1024):
        raise ValueError(f"max_body_bytes: must be an int >= 1024 (got {max_body_bytes!r})")
    server = _Server(get_loop, api_key or None, served_model_name, request_timeout, max_body_bytes,
                     retry_after_s, metrics)
    app.state.kvscope_api = server
    app.add_middleware(_ApiMiddleware, server=server)

    async def health(request: Request):
        ok, why = server.healthy()
        if ok:
            return JSONResponse({"status": "ok", "model": server.model_name_of(server._loop_or_none())})
        return JSONResponse(error_body(why, "server_error", None, 503), 503,
                            headers={"Retry-After": str(retry_after_s)})

    async def metrics_(request: Request):
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(request: Request):
        return JSONResponse(server.models())

    app.add_api_route("/health", _guarded(health), methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", _guarded(metrics_), methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/models", _guarded(models), methods=["GET"])
    app.add_api_route("/v1/completions", _guarded(server.completions), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _guarded(server.chat), methods=["POST"])
    return server


def build_app(loop: EngineLoop, api_key: str | None = None, **kwargs) -> FastAPI:
    """A FastAPI app serving `loop` (started here if it is not yet); kwargs as in `register`."""
    loop.start()
    app = FastAPI(title="kvscope OpenAI-compatible API", docs_url="/docs", redoc_url=None)
    register(app, lambda: loop, api_key, **kwargs)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}", kind, None,
                                       e.status_code), e.status_code, headers=getattr(e, "headers", None))

    return app


class ServerThread:
    """Serve an ASGI app with uvicorn on a background thread (tests, notebooks, benchmarks).

        with ServerThread(build_app(loop)) as srv:      # port 0: a free port, bound before start
            OpenAI(base_url=srv.url + "/v1", api_key="-")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import socket

        import uvicorn
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread = None

    def start(self, timeout: float = 30.0) -> "ServerThread":
        import threading
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name=f"kvscope-api-{self.port}", daemon=True)
        self._thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError(f"the API server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ------------------------------------------------------------------------------------------ CLI
def _field_type(annotation: str):
    a = str(annotation)
    if a.startswith("bool"):
        return bool
    if a.startswith("int"):
        return int
    if a.startswith("float"):
        return float
    return str


def add_engine_args(parser: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """One `--field-name` flag per EngineConfig field (booleans get --x / --no-x)."""
    defaults = defaults or {}
    group = parser.add_argument_group("engine (EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        typ = _field_type(f.type)
        if typ is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        else:
            conv = typ
            if "None" in str(f.type):
                conv = (lambda t: lambda s: None if s.lower() in ("none", "") else t(s))(typ)
            group.add_argument(flag, dest=f.name, type=conv, default=default, metavar=typ.__name__.upper())


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                           if hasattr(args, f.name)})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on /v1/*")
    g.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's)")
    g.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds before a request is aborted with 504 (0: never)")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    g.add_argument("--retry-after", type=int, default=1, help="Retry-After seconds on 503")
    g.add_argument("--log-level", default="info")


def server_kwargs(args: argparse.Namespace) -> dict:
    """`register`/`build_app` keyword arguments from the flags of `add_server_args`."""
    return dict(api_key=args.api_key, served_model_name=args.served_model_name,
                request_timeout=args.request_timeout or None, max_body_bytes=args.max_body_bytes,
                retry_after_s=args.retry_after)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(prog="python -m engine.entrypoints.openai.api_server",
                                     description="kvscope's OpenAI-compatible API server")
    add_server_args(parser)
    add_engine_args(parser, defaults={"max_waiting_requests": 256})
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loop = EngineLoop(engine_config_from_args(args))
    app = build_app(loop, **server_kwargs(args))
    log.info("serving %s on http://%s:%d (max_waiting_requests=%s)",
             app.state.kvscope_api.model_name_of(loop), args.host, args.port, loop.config.max_waiting_requests)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    timeout_graceful_shutdown=5)
    finally:
        loop.shutdown()


if __name__ == "__main__":
    main()
