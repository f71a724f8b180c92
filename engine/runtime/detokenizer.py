"""Incremental detokenization and stop-string handling.

Text is decoded over a short sliding window of token ids (vLLM's prefix/read offsets), so each new
token costs O(1) and a multi-byte UTF-8 character split across tokens is emitted only once complete.
Streamed text holds back any tail that could still become a stop string.
"""
from __future__ import annotations

from engine.core.sequence import Sequence

_CONTEXT = 6  # prompt tokens decoded ahead of the output, so leading spaces come out right
_MAX_PENDING = 4  # tokens held back waiting for text: a UTF-8 character spans at most 4 byte tokens


class Detokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_limit = len(tokenizer) if tokenizer is not None else 0
        # the Rust tokenizer behind a fast HF tokenizer decodes the same text without transformers' per-call
        # Python work (a few µs against 10-15 µs; two decodes per generated token)
        rust = getattr(tokenizer, "_tokenizer", None)
        self._rust = rust if callable(getattr(rust, "decode", None)) else None

    def start(self, seq: Sequence) -> None:
        ctx = min(_CONTEXT, seq.num_prompt_tokens)
        seq.prefix_offset = seq.num_prompt_tokens - ctx
        seq.read_offset = seq.num_prompt_tokens

    def _decode(self, ids: list[int], skip: bool) -> str:
        if ids and max(ids) >= self.vocab_limit:
            ids = [t for t in ids if t < self.vocab_limit]
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=skip)
        return self.tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def update(self, seq: Sequence) -> str:
        """Decode the sequence's newest tokens into seq.text; returns the text appended."""
        if self.tok is None:
            return ""
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix = self._decode(ids[seq.prefix_offset:seq.read_offset], skip)
        full = self._decode(ids[seq.prefix_offset:], skip)
        # Tokens that add no text yet are held back: an incomplete UTF-8 character. Past _MAX_PENDING of them
        # nothing will complete it (or they decode to nothing: skipped special tokens), and the window moves on
        # anyway, so that decoding stays O(1) a token.
        if (len(full) > len(prefix) and not full.endswith("\ufffd")) or len(ids) - seq.read_offset > _MAX_PENDING:
            new = full[len(prefix):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
            seq.text += new
            return new
        return ""

    def decode_one(self, token_id: int) -> str:
        if self.tok is None or token_id >= self.vocab_limit:
            return ""
        return self.tok.decode([token_id], skip_special_tokens=False)


def check_stop_strings(seq: Sequence, new_text: str) -> str | None:
    """If a stop string now occurs in seq.text, truncate the text there and return that string."""
    stops = seq.params.stop
    if not stops or not new_text:
        return None
    for s in stops:
        start = max(0, len(seq.text) - len(new_text) - len(s) + 1)
        idx = seq.text.find(s, start)
        if idx >= 0:
            end = idx + len(s) if seq.params.include_stop_str_in_output else idx
            seq.text = seq.text[:end]
            return s
    return None


def streamable_len(seq: Sequence) -> int:
    """How much of seq.text may be streamed: all but a tail that is a prefix of some stop string."""
    if seq.is_finished or not seq.params.stop:
        return len(seq.text)
    text = seq.text
    hold = 0
    for s in seq.params.stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return len(text) - hold
