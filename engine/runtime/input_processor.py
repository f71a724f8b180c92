"""Input processing: a prompt (text or token ids) and SamplingParams -> a validated Sequence, checked against the
model's vocabulary, max_model_len and the KV pool, its grammar compiled. Runs on the caller's thread (the API
server's, or the engine's in-process caller); it reads no engine state that a step changes."""
from __future__ import annotations

import itertools
import time

from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                 grammar_compiler):
        self.tokenizer = tokenizer
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.grammar_compiler = grammar_compiler
        self._ids = itertools.count()

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for `messages`; tools: passed to a template that renders them (OpenAI's shape)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...}")
        kw = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kw)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Validate a request without touching engine state (safe from any thread)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("params: must be a SamplingParams")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            text, ids = prompt, self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, list(prompt)
            V = self.vocab_size
            if not all(isinstance(t, int) and 0 <= t < V for t in ids):
                raise ValueError(f"prompt: token ids must be ints in [0, {V})")
        else:
            raise ValueError("prompt: must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        V = self.vocab_size
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {V})")
        bad = [t for t in (params.logit_bias or ()) if t >= V]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens is too long; max_model_len is {self.max_model_len} "
                             "and at least one output token must fit")
        total = min(len(ids) + params.max_tokens, self.max_model_len)
        need = -(-total // self.block_size)
        if need > self.num_blocks - 1:
            raise ValueError(f"max_tokens: prompt + max_tokens = {total} tokens needs {need} KV blocks, but the "
                             f"pool has {self.num_blocks - 1}; lower max_tokens or the prompt")
        # compiled here, on the caller's thread and once per distinct constraint; ValueError names the field
        matcher = self.grammar_compiler.matcher(params.structured_outputs) if params.structured_outputs else None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, text, ids, params, arrival_time if arrival_time is not None else time.perf_counter())
        seq.matcher = matcher
        return seq
