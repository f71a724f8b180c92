"""The host's side of a grammar block (engine/worker/multi_step.py): feeding sampled tokens to the matchers inside a
block."""
from __future__ import annotations

from engine.runtime.output_processor import consume_grammar
from engine.core.sequence import Sequence


def feed_grammars(seqs: list[Sequence], tokens: list[int]) -> None:
    """Inside a grammar block: feed each constrained request's last sampled token to its matcher, keeping the
    outcome for post-processing. A request whose grammar ended earlier in the block ignores the rest
    (post-processing stops it at that token)."""
    for seq, tok in zip(seqs, tokens):
        m = seq.matcher
        if m is not None and not seq.is_finished and not (m.is_stopped() or m.is_error()):
            seq.grammar_ahead.append(consume_grammar(seq, tok))
