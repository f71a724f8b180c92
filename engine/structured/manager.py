"""StructuredOutputManager (vLLM's name): the grammar compiler, the count of unfinished constrained requests and
the per-step token bitmask that masks their logits rows before sampling."""
from __future__ import annotations

import torch

from engine.core.sequence import Sequence
from engine.structured.compiler import GrammarCompiler


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], device: torch.device,
                 fused_bitmask: bool, mask_threads: int | None):
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.device, self.fused_bitmask, self.mask_threads = device, fused_bitmask, mask_threads
        self.num_constrained = 0            # unfinished requests with a grammar (0: no mask work at all)
        self.bitmask = None                 # bitmask.TokenBitmask, made for the first constraint

    def add(self, seq: Sequence) -> None:
        if seq.matcher is not None:
            self.num_constrained += 1

    def remove(self, seq: Sequence) -> None:
        if seq.matcher is not None:
            self.num_constrained -= 1

    def token_bitmask(self):
        if self.bitmask is None:
            from engine.structured.bitmask import TokenBitmask
            self.bitmask = TokenBitmask(self.compiler.mask_vocab_size, self.device, fused=self.fused_bitmask,
                                        threads=self.mask_threads)
        return self.bitmask

    def apply(self, row_seqs: list[Sequence | None], logits: torch.Tensor) -> None:
        """-inf on the logits of tokens a constrained request's grammar forbids next. row_seqs[r]: the sequence
        whose next token logits row r samples (None: a draft position). Constrained requests get no drafts, so
        each has one logits row."""
        rows = [r for r, seq in enumerate(row_seqs) if seq is not None and seq.matcher is not None
                and not (seq.matcher.is_stopped() or seq.matcher.is_error())]   # (ended inside a grammar block)
        if rows:
            self.token_bitmask().apply(logits, [row_seqs[r].matcher for r in rows], rows)
