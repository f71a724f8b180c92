"""The host's side of a grammar block (engine/worker/multi_step.py): feeding sampled tokens to the matchers inside a block,
and the gated block's grammar thread that fills each iteration's masks."""
from __future__ import annotations

import queue
import time

import torch

from engine.runtime.output_processor import consume_grammar
from engine.core.sequence import Sequence


def fill_grammar_slots(gate, tb, alive: list[int], live: list[Sequence], matchers: list, slots: torch.Tensor,
                       base: int, copies: queue.SimpleQueue) -> float:
    """The grammar thread of a gated block: slot j's masks once tokens j - 1 are fed -> seconds filling."""
    spent = 0.0
    try:
        for j in range(slots.shape[0]):
            if j:
                copy = copies.get()
                if copy is None:
                    break
                host = copy.tolist()                                                      # [B]
                feed_grammars(live, [host[i] for i in alive])
            t = time.perf_counter()
            tb.fill_slot(matchers, slots[j])
            spent += time.perf_counter() - t
            gate.open(base + j + 1)
    finally:
        gate.open(base + slots.shape[0])            # never leave the stream waiting
    return spent


def feed_grammars(seqs: list[Sequence], tokens: list[int]) -> None:
    """Inside a grammar block: feed each constrained request's last sampled token to its matcher, keeping the
    outcome for post-processing. A request whose grammar ended earlier in the block ignores the rest
    (post-processing stops it at that token)."""
    for seq, tok in zip(seqs, tokens):
        m = seq.matcher
        if m is not None and not seq.is_finished and not (m.is_stopped() or m.is_error()):
            seq.grammar_ahead.append(consume_grammar(seq, tok))
