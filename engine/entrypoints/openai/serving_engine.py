"""The state and steps every OpenAI endpoint shares: the engine behind the API (looked up per request),
the model check, body parsing, sampling parameters, and the all-or-nothing submission of a request.

Submitting never waits for an engine step (`EngineLoop.submit_many`); text prompts are tokenized (and chat
templates rendered) on worker threads, at most `preprocess_concurrency` at once, so the event loop keeps
serving other clients and a burst of large prompts cannot take every core and its memory.
"""
from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from typing import Any, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from engine.runtime.async_engine import EngineLoop
from engine.runtime.llm_engine import EngineOverloaded
from engine.sampling_params import SamplingParams

from engine.entrypoints.openai.errors import APIError, engine_unavailable, server_overloaded, validation_error, value_error
from engine.entrypoints.openai.job import Job
from engine.entrypoints.openai.metrics import ServerMetrics
from engine.entrypoints.openai.protocol import usage_dict, vllm_prompt_logprobs
from engine.entrypoints.openai.tracing import RequestTracer, trace_headers


# threads that tokenize and render chat templates at once; more requests wait their turn (cheaply: their
# bodies are already read and bounded by max_body_bytes)
DEFAULT_PREPROCESS_CONCURRENCY = max(1, min(4, (os.cpu_count() or 2) // 2))


def arrival_of(request: Request) -> float:
    """When the server received `request` (stamped by the API middleware; now if it was not)."""
    return request.scope.get("state", {}).get("kvscope_arrival") or time.perf_counter()


# Chunks a second one API server process sends under --stream-interval-ms auto: about half of what either end
# manages at ~100 µs of CPU a chunk (this process writing them, a Python client process parsing them)
STREAM_CHUNK_RATE = 5000.0

class OpenAIServing:
    """What every endpoint shares: the engine behind the API, body parsing, and the submission of a request."""

    def __init__(self, get_loop: Callable[[], EngineLoop], api_key: str | None, served_model_name: str | None,
                 request_timeout: float | None, max_body_bytes: int, retry_after_s: int,
                 metrics: ServerMetrics | None, stream_interval: int = 1, stream_interval_ms: float | str = 0.0):
        self.get_loop = get_loop
        self.api_key = api_key
        self.served_model_name = served_model_name
        self.request_timeout = request_timeout
        self.max_body_bytes = max_body_bytes
        self.retry_after_s = retry_after_s
        self.stream_interval = stream_interval             # tokens per streamed chunk, at least (vLLM's)
        self.stream_interval_ms = stream_interval_ms       # and ms after the stream's last chunk, or "auto"
        self.open_streams = 0                              # choices of the SSE responses being written
        self.metrics = metrics or ServerMetrics(self.loop_or_none, self.model_name_of)
        self.tracer: RequestTracer | None = None          # OpenTelemetry spans (--otlp-traces-endpoint)
        self.created = int(time.time())
        self.preprocess_concurrency = DEFAULT_PREPROCESS_CONCURRENCY
        self._preprocess_limiter: anyio.CapacityLimiter | None = None

    async def preprocess(self, fn: Callable, *args):
        """Run CPU work of a request (tokenization, chat template) on a worker thread, at most
        `preprocess_concurrency` at once."""
        if self._preprocess_limiter is None:
            self._preprocess_limiter = anyio.CapacityLimiter(self.preprocess_concurrency)
        return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._preprocess_limiter)

    # ---- the engine behind the API ------------------------------------------------------------
    def stream_wait_s(self) -> float:
        """Seconds a stream's next chunk waits after its last one (stream_interval_ms); "auto": this process's open
        streams / STREAM_CHUNK_RATE, so that its chunks stay under that rate and few streams wait for nothing."""
        if self.stream_interval_ms == "auto":
            return self.open_streams / STREAM_CHUNK_RATE
        return self.stream_interval_ms / 1e3

    def loop_or_none(self) -> EngineLoop | None:
        try:
            return self.get_loop()
        except Exception:  # noqa: BLE001 - no engine right now (starting, restarting, failed)
            return None

    def current(self) -> EngineLoop:
        try:
            loop = self.get_loop()
        except Exception as e:  # noqa: BLE001
            raise engine_unavailable(self.retry_after_s, e)
        if loop is None or getattr(loop, "_stop", False):
            raise engine_unavailable(self.retry_after_s)
        return loop

    def model_name_of(self, loop: EngineLoop | None) -> str:
        if self.served_model_name:
            return self.served_model_name
        eng = getattr(loop, "engine", None)
        return str(getattr(eng, "model_name", None) or "kvscope")

    def healthy(self) -> tuple[bool, str]:
        loop = self.loop_or_none()
        if loop is None:
            return False, "no engine (starting, restarting or failed)"
        if not loop.healthy():
            return False, "the engine is not running (starting, restarting after a crash, or shut down)"
        return True, "ok"

    def overloaded(self, loop: EngineLoop, detail: str) -> APIError:
        return server_overloaded(loop.engine.config.scheduler_config.max_waiting_requests, self.retry_after_s, detail)

    def check_model(self, model: str | None, loop: EngineLoop) -> None:
        name = self.model_name_of(loop)
        if model and model != name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{name}` "
                           "(see GET /v1/models).", 404, "NotFoundError", param="model", code="model_not_found")

    # ---- request parsing ----------------------------------------------------------------------
    async def open_request(self, request: Request, model_cls) -> tuple[Any, EngineLoop]:
        """Parse and check a body, and pick the engine that will serve it (the model must be its model)."""
        req = await self.read_json(request, model_cls)
        req.check_unsupported()
        loop = self.current()
        self.check_model(req.model, loop)
        return req, loop

    async def read_json(self, request: Request, model_cls):
        return self.parse(await self.read_body(request), model_cls)

    @staticmethod
    def parse(body: bytes, model_cls):
        if not body.strip():
            raise APIError("request body: must be a JSON object (got an empty body)", code="invalid_body")
        try:
            return model_cls.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e)

    async def read_body(self, request: Request) -> bytes:
        """The body's bytes: JSON by its Content-Type (415 otherwise), at most max_body_bytes (413)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype and ctype != "application/json" and not ctype.endswith("+json"):
            raise APIError(f"Content-Type: must be application/json (got {ctype[:60]!r})", 415,
                           code="unsupported_media_type")
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
        body = bytearray()           # one growing buffer: the read chunks are freed as they come (no heap litter)
        async for chunk in request.stream():
            if len(body) + len(chunk) > limit:
                raise APIError(f"request body exceeds {limit} bytes", 413, code="body_too_large")
            body += chunk
        return bytes(body)

    def _sampling(self, req, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(max_tokens=max_tokens, seed=seed, logprobs=logprobs, stop=list(req.stop or []),
                                  stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                                  min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  priority=req.priority, structured_outputs=req.structured_constraint(),
                                  logit_bias=req.logit_bias, prompt_logprobs=req.prompt_logprobs)
        if getattr(req, "echo", False) and req.logprobs is not None:     # legacy echo: the prompt's logprobs too
            kw["prompt_logprobs"] = max(req.prompt_logprobs or 0, req.logprobs)
        if req.priority:                   # as vLLM: a priority needs the priority policy (a 400 otherwise)
            cfg = getattr(getattr(self.loop_or_none(), "engine", None), "config", None)
            if cfg is None or cfg.scheduler_config.scheduling_policy != "priority":
                raise ValueError(f"priority: got {req.priority}, but priority scheduling is not enabled on this "
                                 "server (EngineConfig.scheduling_policy is 'fcfs')")
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)

    # ---- submission: validation, tokenization, the all-or-nothing enqueue ------------------------
    def _submit(self, loop: EngineLoop, prompts: list, req, chat: bool, arrival_time: float) -> Job:
        eng = loop.engine
        limit = eng.config.scheduler_config.max_waiting_requests
        total = req.n * len(prompts)
        if limit is not None and total > limit:     # a 400: waiting (a 503's Retry-After) could never help
            param = "n" if req.n > 1 else ("messages" if chat else "prompt")
            raise APIError(f"{param}: this request is {total} sequences (n={req.n} x {len(prompts)} prompt(s)); "
                           f"the engine's waiting queue holds at most {limit} (max_waiting_requests), so it "
                           "could never be admitted", param=param, code="invalid_value")
        limit_param = req.limit_param if chat else "max_tokens"
        rename = {"logprobs": "top_logprobs" if chat else "logprobs", "prompt": "messages" if chat else "prompt",
                  "max_tokens": limit_param, **req.structured_param_names()}
        prompt_ids: list[list[int]] = []
        for p in prompts:
            try:
                ids = eng.tokenize(p) if isinstance(p, str) else list(p)
            except ValueError as e:
                raise value_error(e, rename)
            if not ids:
                what = "messages" if chat else "prompt"
                raise APIError(f"{what}: must contain at least one token", param=what)
            k = req.truncate_prompt_tokens
            if k is not None:                      # vLLM's: keep the last k tokens (-1: all that leave room for one)
                ids = ids[-(eng.max_model_len - 1 if k == -1 else k):]
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
                    raise value_error(e, rename)
                prompt_of.append(pi)
        # Accept the whole request or none of it: submit_many checks capacity and enqueues atomically,
        # and never waits for an engine step.
        base = uuid.uuid4().hex
        rids = [f"{base}-{i}" for i in range(len(params))]
        try:
            streams = loop.submit_many([(prompt_ids[prompt_of[i]], sp, rid) for i, (sp, rid)
                                        in enumerate(zip(params, rids))], arrival_time)
        except EngineOverloaded as e:
            raise self.overloaded(loop, str(e))
        except ValueError as e:
            raise value_error(e, rename)
        except RuntimeError as e:
            raise engine_unavailable(self.retry_after_s, e)
        job = Job(self, loop, rids, streams, prompt_ids, prompt_of, params)
        job.id_base = base
        self.metrics.observe_params(job.model_name, req.n, [sp.max_tokens for sp in params])
        return job

    async def submit(self, request: Request, loop: EngineLoop, prompts: list, req, chat: bool) -> Job:
        """Submit on the event loop when the prompts are token ids (nothing to wait for); text prompts are
        tokenized on a worker thread. Arrival is when the request reached the server (`arrival_of`)."""
        arrival = arrival_of(request)
        if all(isinstance(p, list) for p in prompts):
            job = self._submit(loop, prompts, req, chat, arrival)
        else:
            job = await self.preprocess(self._submit, loop, prompts, req, chat, arrival)
        if self.tracer is not None:
            job.trace_headers = trace_headers(request.headers)
            job.n = req.n
        job.attach()
        return job

    async def run_to_end(self, job: Job, request: Request) -> None:
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

    @staticmethod
    def final_response(job: Job, req, id_: str, obj: str, choices: list[dict], prompt_token_ids) -> JSONResponse:
        """The non-streaming body: choices (plus their token ids when asked), usage, prompt ids when asked."""
        if req.prompt_logprobs is not None and obj == "text_completion":
            for c, out in zip(choices, job.finals):
                c["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs or [], req.return_tokens_as_token_ids)
        if req.return_token_ids:
            for i, (c, out) in enumerate(zip(choices, job.finals)):
                c["token_ids"] = list(out.token_ids)
                c["prompt_token_ids"] = job.prompt_ids[job.prompt_of[i]]
        body = {"id": id_, "object": obj, "created": int(time.time()), "model": job.model_name, "choices": choices,
                "usage": usage_dict(job.prompt_tokens(), sum(len(f.token_ids) for f in job.finals),
                                    job.cached_tokens())}
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_token_ids
        if req.prompt_logprobs is not None and obj == "chat.completion":     # vLLM: once, on the response
            body["prompt_logprobs"] = vllm_prompt_logprobs(job.finals[0].prompt_logprobs or [],
                                                           req.return_tokens_as_token_ids)
        return JSONResponse(body)

    # ---- /v1/models ---------------------------------------------------------------------------
    def show_available_models(self) -> dict:
        loop = self.current()
        eng = loop.engine
        name = self.model_name_of(loop)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "kvscope",
            "root": str(eng.config.model_config.model or name), "parent": None, "max_model_len": eng.max_model_len,
            "vocab_size": int(getattr(getattr(eng, "arch_config", None), "vocab_size", 0) or 0)}]}
