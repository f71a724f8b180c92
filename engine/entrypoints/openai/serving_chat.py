"""`POST /v1/chat/completions`: a ChatCompletionRequest -> chat template -> the engine -> a chat
completion or its SSE stream, with tool calls parsed out of the output (tools.py)."""
from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.errors import APIError, value_error
from engine.entrypoints.openai.job import Job, SSEResponse, sse_stream, stream_choice
from engine.entrypoints.openai.protocol import ChatCompletionRequest, chat_logprobs
from engine.entrypoints.openai.serving_engine import OpenAIServing
from engine.entrypoints.openai.tool_parsers import ToolParser, tool_parser_for
from engine.entrypoints.openai.tools import ToolChoice, ToolStream, finish_reason, parse_output, render_chat


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing, tool_call_parser: str | None = None):
        self.serving = serving
        self.tool_call_parser = tool_call_parser
        tool_parser_for(tool_call_parser, None)          # an unknown name fails at start-up

    def tool_parser(self, tokenizer) -> ToolParser:
        return tool_parser_for(self.tool_call_parser, getattr(tokenizer, "chat_template", None))

    async def create_chat_completion(self, request: Request) -> Response:
        req, loop = await self.serving.open_request(request, ChatCompletionRequest)
        choice = req.tool_choice_mode()
        parser = self.tool_parser(loop.engine.tokenizer)
        try:
            prompt = await self.serving.preprocess(render_chat, loop.engine, req.messages, req.tools, choice, parser,
                                                   req.add_generation_prompt, req.continue_final_message)
        except ValueError as e:
            raise value_error(e, {})
        except Exception as e:  # noqa: BLE001 - a template that raises on these messages (e.g. role order)
            raise APIError(f"messages: the chat template rejected them: {e}", param="messages")
        job = await self.serving.submit(request, loop, [prompt], req, chat=True)
        top_n = req.top_logprobs or 0
        if req.stream:
            return SSEResponse(self.chat_completion_stream_generator(req, job, top_n, choice, parser), job)
        await self.serving.run_to_end(job, request)
        choices = []
        for i, out in enumerate(job.finals):
            lp = None
            if req.logprobs and out.logprobs is not None:
                lp = chat_logprobs(out.logprobs[:len(out.token_ids)], top_n, req.return_tokens_as_token_ids)
            content, calls = parse_output(out.text, choice, parser, req.parallel_tool_calls)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.to_dict() for c in calls]
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason(out.finish_reason, choice, bool(calls)),
                            "stop_reason": out.stop_reason})
        return self.serving.final_response(job, req, f"chatcmpl-{job.id_base}", "chat.completion", choices,
                                           job.prompt_ids[0])

    def chat_completion_stream_generator(self, req: ChatCompletionRequest, job: Job, top_n: int,
                                         choice: ToolChoice, parser: ToolParser) -> AsyncIterator[str]:
        return sse_stream(job, req, f"chatcmpl-{job.id_base}", "chat.completion.chunk",
                          self._stream_choices(req, job, top_n, choice, parser),
                          {"prompt_token_ids": job.prompt_ids[0]} if req.return_token_ids else None)

    @staticmethod
    async def _stream_choices(req: ChatCompletionRequest, job: Job, top_n: int, choice: ToolChoice,
                              parser: ToolParser) -> AsyncIterator[tuple[dict | None, int]]:
        k = len(job.streams)
        ntok = [0] * k
        tool_streams = [ToolStream(choice, parser, req.parallel_tool_calls) for _ in range(k)]
        for i in range(k):              # as OpenAI: each choice's first chunk carries the role alone
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            if req.return_token_ids:
                first["prompt_token_ids"] = job.prompt_ids[job.prompt_of[i]]
            yield first, 0
        gen = 0
        async for i, out in job.outputs():
            new = list(out.delta_token_ids)
            gen += len(new)
            lp = None
            if req.logprobs and out.logprobs is not None:
                lp = chat_logprobs(out.logprobs[ntok[i]:ntok[i] + len(new)], top_n,
                                   req.return_tokens_as_token_ids)
            ntok[i] += len(new)
            ts = tool_streams[i]
            content, calls = ts.feed(out.delta_text)
            if out.finished:
                more, more_calls = ts.finish()
                content, calls = content + more, calls + more_calls
            if not content and not calls and not out.finished and lp is None \
                    and not (req.return_token_ids and new):
                yield None, gen
                continue
            delta: dict[str, Any] = {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            c = stream_choice(i, out, lp, new, req.return_token_ids, delta=delta)
            if out.finished:
                c["finish_reason"] = finish_reason(out.finish_reason, choice, ts.called)
            yield c, gen
