"""Input processing: a prompt (text or token ids) and SamplingParams -> a validated Sequence, checked against the
model's vocabulary, max_model_len and the KV pool, its grammar compiled. Runs on the caller's thread (the API
server's, or the engine's in-process caller); it reads no engine state that a step changes.

Text that cannot fit is refused before it is tokenized: a token of the vocabulary covers at most
`max_token_bytes` bytes of text, so a text of more than max_model_len * max_token_bytes bytes has more than
max_model_len tokens (`max_text_bytes`). Checked on characters first (never more than bytes), then on bytes,
so a 4 MiB prompt costs no tokenization and no memory beyond its own string."""
from __future__ import annotations

import itertools
import time
from typing import Any

from engine.sampling_params import SamplingParams
from engine.core.sequence import Sequence


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                 grammar_compiler, eos_token_ids: set[int] = frozenset()):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.block_size, self.num_blocks = block_size, num_blocks
        self.grammar_compiler = grammar_compiler
        self._ids = itertools.count()
        self.max_token_bytes = max_token_bytes(tokenizer)
        self.max_text_bytes = None if self.max_token_bytes is None else self.max_token_bytes * max_model_len

    def check_text_size(self, field: str, n_chars: int, text: str | None = None) -> None:
        """Refuse text that cannot fit in max_model_len tokens, without tokenizing it. `n_chars` is its length
        in characters; `text` (when given) is measured in bytes too, only if its characters could not decide."""
        limit = self.max_text_bytes
        if limit is None:
            return
        n_bytes = n_chars
        if n_chars <= limit < 4 * n_chars and text is not None:     # 1-4 UTF-8 bytes per character
            n_bytes = len(text.encode("utf-8", "surrogatepass"))
        if n_bytes > limit:
            unit = "characters" if n_bytes == n_chars else "bytes"
            raise ValueError(f"{field}: {n_bytes} {unit} cannot fit in max_model_len {self.max_model_len} tokens "
                             f"(a token covers at most {self.max_token_bytes} bytes of text, so at most {limit} "
                             "bytes fit); shorten it")

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
        self.check_text_size("prompt", len(prompt), prompt)
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False) -> str:
        """The prompt text for `messages`; tools: passed to a template that renders them (OpenAI's shape);
        continue_final_message: the last (assistant) message is left open for the model to continue."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages: must be a non-empty list of {'role': ..., 'content': ...}")
        # the rendered conversation holds every message's content: refuse it before rendering
        self.check_text_size("messages", sum(_text_chars(m.get("content")) for m in messages))
        kw = {"tools": tools} if tools else {}
        if continue_final_message:
            kw["continue_final_message"] = True
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
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size})")
        else:
            raise ValueError("prompt: must be a string or a list of token ids")
        if not ids:
            raise ValueError("prompt: must contain at least one token")
        V = self.vocab_size
        if any(t >= V for t in params.stop_token_ids):     # the min_tokens ban indexes the logits by them
            raise ValueError(f"stop_token_ids: must be token ids in [0, {V}) "
                             f"(got {max(params.stop_token_ids)})")
        banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.min_tokens and not params.structured_outputs and len(banned) >= V:
            raise ValueError(f"stop_token_ids: with EOS they are all {V} tokens, so min_tokens "
                             f"({params.min_tokens}) would leave no token to sample")
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


def _text_chars(content: Any) -> int:
    """Characters of a message's content: a string, or parts (lists/dicts) holding strings."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, dict):
        return sum(_text_chars(v) for v in content.values())
    if isinstance(content, (list, tuple)):
        return sum(_text_chars(v) for v in content)
    return 0


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token of `tokenizer` can stand for (None: unknown, no bound).

    A byte-level BPE token string has one character per byte (added tokens excepted); otherwise a token's UTF-8 length bounds the
    text it matches (byte-fallback and metaspace tokens only overstate it). A normalizer may shrink text
    before it is split (NFKC folds up to 4 bytes into 1), so its bound is widened 4x."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: no bound
        return None
    if not vocab:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "pre_tokenizer", None)).__name__ == "ByteLevel"
    added = set(getattr(tokenizer, "get_added_vocab", dict)())      # matched on raw text: UTF-8 length
    n = max(len(t) if byte_level and t not in added else len(t.encode("utf-8", "surrogatepass")) for t in vocab)
    if getattr(backend, "normalizer", None) is not None:
        n *= 4
    return max(n, 4)        # an unknown character maps to one token: up to 4 bytes
