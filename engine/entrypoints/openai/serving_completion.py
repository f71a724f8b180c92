"""`POST /v1/completions`: a CompletionRequest -> the engine -> a completion or its SSE stream."""
from __future__ import annotations

from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.runtime.async_engine import EngineLoop

from engine.entrypoints.openai.job import Job, SSEResponse, sse_stream, stream_choice
from engine.entrypoints.openai.protocol import CompletionRequest, completion_logprobs, echo_logprobs, join_logprobs
from engine.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create_completion(self, request: Request) -> Response:
        req, loop = await self.serving.open_request(request, CompletionRequest)
        job = await self.serving.submit(request, loop, req.prompt, req, chat=False)
        echo = [self._echo_text(loop, p) for p in req.prompt] if req.echo else None
        if req.stream:
            return SSEResponse(self.completion_stream_generator(req, job, echo), job)
        await self.serving.run_to_end(job, request)
        choices = []
        for i, out in enumerate(job.finals):
            text = (echo[job.prompt_of[i]] if echo else "") + out.text
            lp = None
            if req.logprobs is not None and out.logprobs is not None:
                lp = completion_logprobs(out.logprobs[:len(out.token_ids)], len(echo[job.prompt_of[i]]) if echo else 0,
                                         req.logprobs, req.return_tokens_as_token_ids)
                if echo:
                    lp = join_logprobs(self._echo_logprobs(req, job, i, out), lp)
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason})
        return self.serving.final_response(job, req, f"cmpl-{job.id_base}", "text_completion", choices,
                                           job.prompt_ids[0] if len(job.prompt_ids) == 1 else job.prompt_ids)

    @staticmethod
    def _echo_logprobs(req: CompletionRequest, job: Job, i: int, out) -> dict:
        ids = job.prompt_ids[job.prompt_of[i]]
        tok = job.loop.engine.tokenizer
        first = tok.decode(ids[:1], skip_special_tokens=False) if tok is not None else ""
        return echo_logprobs(out.prompt_logprobs or [None], first, ids[0], req.logprobs,
                             req.return_tokens_as_token_ids)

    @staticmethod
    def _echo_text(loop: EngineLoop, p) -> str:
        if isinstance(p, str):
            return p
        tok = loop.engine.tokenizer
        return tok.decode(p, skip_special_tokens=False) if tok is not None else ""

    def completion_stream_generator(self, req: CompletionRequest, job: Job, echo) -> AsyncIterator[str]:
        return sse_stream(job, req, f"cmpl-{job.id_base}", "text_completion", self._stream_choices(req, job, echo))

    @staticmethod
    async def _stream_choices(req: CompletionRequest, job: Job, echo) -> AsyncIterator[tuple[dict | None, int]]:
        k = len(job.streams)
        ntok, started = [0] * k, [False] * k
        nchar = [len(echo[job.prompt_of[i]]) if echo else 0 for i in range(k)]
        gen = 0
        async for i, out in job.outputs():
            new = list(out.delta_token_ids)
            gen += len(new)
            lp = None
            if req.logprobs is not None and out.logprobs is not None:
                lp = completion_logprobs(out.logprobs[ntok[i]:ntok[i] + len(new)], nchar[i], req.logprobs,
                                         req.return_tokens_as_token_ids)
            ntok[i] += len(new)
            text = out.delta_text
            if echo and not started[i]:
                text = echo[job.prompt_of[i]] + text
                if lp is not None:
                    lp = join_logprobs(OpenAIServingCompletion._echo_logprobs(req, job, i, out), lp)
            if not text and not out.finished and lp is None and not (req.return_token_ids and new):
                yield None, gen
                continue
            c = stream_choice(i, out, lp, new, req.return_token_ids, text=text)
            if req.return_token_ids and not started[i]:
                c["prompt_token_ids"] = job.prompt_ids[job.prompt_of[i]]
            started[i] = True
            nchar[i] += len(out.delta_text)
            yield c, gen
