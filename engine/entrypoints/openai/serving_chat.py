"""`POST /v1/chat/completions`: a ChatCompletionRequest -> chat template -> the engine -> a chat
completion or its SSE stream."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.errors import APIError, value_error
from engine.entrypoints.openai.job import Job, SSEResponse, sse_stream, stream_choice
from engine.entrypoints.openai.protocol import ChatCompletionRequest, chat_logprobs
from engine.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create_chat_completion(self, request: Request) -> Response:
        req, loop = await self.serving.open_request(request, ChatCompletionRequest)
        try:
            prompt = await self.serving.preprocess(loop.engine.apply_chat_template, req.messages,
                                                   req.add_generation_prompt)
        except ValueError as e:
            raise value_error(e, {})
        except Exception as e:  # noqa: BLE001 - a template that raises on these messages (e.g. role order)
            raise APIError(f"messages: the chat template rejected them: {e}", param="messages")
        job = await self.serving.submit(request, loop, [prompt], req, chat=True)
        top_n = req.top_logprobs or 0
        if req.stream:
            return SSEResponse(self.chat_completion_stream_generator(req, job, top_n), job)
        await self.serving.run_to_end(job, request)
        choices = []
        for i, out in enumerate(job.finals):
            lp = None
            if req.logprobs and out.logprobs is not None:
                lp = chat_logprobs(out.logprobs[:len(out.token_ids)], top_n)
            choices.append({"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": lp,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return self.serving.final_response(job, req, f"chatcmpl-{job.id_base}", "chat.completion", choices,
                                           job.prompt_ids[0])

    def chat_completion_stream_generator(self, req: ChatCompletionRequest, job: Job, top_n: int) -> AsyncIterator[str]:
        return sse_stream(job, req, f"chatcmpl-{job.id_base}", "chat.completion.chunk",
                          self._stream_choices(req, job, top_n))

    @staticmethod
    async def _stream_choices(req: ChatCompletionRequest, job: Job, top_n: int) -> AsyncIterator[tuple[dict | None, int]]:
        k = len(job.streams)
        ntok, started = [0] * k, [False] * k
        gen = 0
        async for i, out in job.outputs():
            new = list(out.delta_token_ids)
            gen += len(new)
            lp = None
            if req.logprobs and out.logprobs is not None:
                lp = chat_logprobs(out.logprobs[ntok[i]:ntok[i] + len(new)], top_n)
            ntok[i] += len(new)
            if not out.delta_text and not out.finished and lp is None and started[i] \
                    and not (req.return_token_ids and new):
                yield None, gen
                continue
            delta: dict[str, Any] = {}
            if not started[i]:
                delta["role"] = "assistant"
                started[i] = True
            if out.delta_text or "role" in delta:
                delta["content"] = out.delta_text
            yield stream_choice(i, out, lp, new, req.return_token_ids, delta=delta), gen
