"""vLLM's tokenizer routes: `POST /tokenize` (a prompt, or chat messages through the chat template),
`POST /detokenize`, `GET /tokenizer_info`; and `GET /version`."""
from __future__ import annotations

import json
from importlib import metadata
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from engine.entrypoints.openai.errors import APIError, value_error
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.serving_engine import OpenAIServing
from engine.entrypoints.openai.tools import render_chat


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def version() -> str:
    try:
        return metadata.version("kvscope")
    except metadata.PackageNotFoundError:
        return "0.1.0"


class OpenAIServingTokenization:
    def __init__(self, serving: OpenAIServing, chat):
        self.serving, self.chat = serving, chat       # chat: OpenAIServingChat (renders messages + tools)

    def _tokenizer(self):
        loop = self.serving.current()
        tok = loop.engine.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer", code="no_tokenizer")
        return loop, tok

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await self.serving.read_body(request)
        loop, tok = self._tokenizer()
        try:
            chat_form = "messages" in json.loads(body)
        except (ValueError, TypeError):
            chat_form = False                               # parse() below names what is wrong
        if chat_form:                                       # rendered as /v1/chat/completions would
            req = self.serving.parse(body, _TokenizeChatRequest)
            self.serving.check_model(req.model, loop)
            choice = req.tool_choice_mode()
            parser = self.chat.tool_parser(tok)
            try:
                text = await run_in_threadpool(render_chat, loop.engine, req.messages, req.tools, choice, parser,
                                               req.add_generation_prompt, req.continue_final_message)
            except ValueError as e:
                raise value_error(e, {})
            ids = await run_in_threadpool(loop.engine.tokenize, text) if not req.add_special_tokens else \
                await run_in_threadpool(tok.encode, text, add_special_tokens=True)
        else:
            req = self.serving.parse(body, TokenizeCompletionRequest)
            self.serving.check_model(req.model, loop)
            ids = await run_in_threadpool(tok.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": loop.engine.max_model_len, "tokens": ids}
        if getattr(req, "return_token_strs", False):
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> JSONResponse:
        req = self.serving.parse(await self.serving.read_body(request), DetokenizeRequest)
        loop, tok = self._tokenizer()
        self.serving.check_model(req.model, loop)
        V = loop.engine.arch_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < V]
        if bad:
            raise APIError(f"tokens: token id {bad[0]} is outside the vocabulary [0, {V})", param="tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    def tokenizer_info(self) -> JSONResponse:
        loop, tok = self._tokenizer()
        eng = loop.engine
        return JSONResponse({
            "tokenizer_class": type(tok).__name__, "vocab_size": len(tok), "model_vocab_size":
            int(eng.arch_config.vocab_size), "max_model_len": eng.max_model_len, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token, "pad_token": tok.pad_token, "eos_token_ids": sorted(eng.eos_token_ids),
            "chat_template": getattr(tok, "chat_template", None)})


class _TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's chat form of /tokenize: the messages (and tools) of a chat request, plus return_token_strs and
    add_special_tokens (added to the rendered template's text; off, as the chat endpoint does)."""
    return_token_strs: bool = False
    add_special_tokens: bool = False
