"""A `LoadSpec` turned into concrete requests: seeded random prompt tokens (special tokens excluded) or templated
chat prompts from the bundled text set (`prompt_source="text"`), output lengths and arrival offsets, one
`LoadItem` per request (per turn for multi-turn chat)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inspector.load.arrivals import arrival_times
from inspector.load.spec import LoadSpec
from inspector.load.text import TextPrompts, can_template


@dataclass
class LoadItem:
    index: int
    user: int
    turn: int
    arrival: float          # offset (s) for first turns; later turns are due after the previous reply
    new_tokens: list[int]   # this turn's new prompt tokens (the runner prepends the conversation)
    max_tokens: int


def _token_pool(vocab_size: int, special_ids=()) -> np.ndarray:
    lo = min(1000, max(1, vocab_size // 10))
    pool = np.arange(lo, max(lo + 1, vocab_size), dtype=np.int64)
    if special_ids:
        pool = pool[~np.isin(pool, np.asarray(list(special_ids), dtype=np.int64))]
    return pool


def build_workload(spec: LoadSpec, vocab_size: int = 32000, special_ids=(), tokenizer=None
                   ) -> tuple[list[int], list[LoadItem]]:
    """(shared prefix tokens, items) for the spec; deterministic for a seed (and tokenizer)."""
    rng = np.random.default_rng(spec.seed)
    pool = _token_pool(vocab_size, special_ids)
    if spec.prompt_source == "text" and not can_template(tokenizer):
        raise ValueError("prompts: 'text' needs a tokenizer with a chat template")
    text = TextPrompts(tokenizer, np.random.default_rng(spec.seed + 2)) if spec.prompt_source == "text" else None
    system = None
    if text is not None and spec.shared_prefix_len:
        prefix, system = text.system_prefix(spec.shared_prefix_len)
    else:
        prefix = rng.choice(pool, size=spec.shared_prefix_len).tolist() if spec.shared_prefix_len else []
    turns = max(1, spec.num_turns)
    users = spec.num_users if turns > 1 else spec.num_requests
    arrivals = arrival_times(users, spec.rate, spec.burstiness, seed=spec.seed + 1)
    p_lens = spec.prompt_len.sample(spec.num_requests, rng)
    o_lens = spec.output_len.sample(spec.num_requests, rng)
    items = []
    for i in range(spec.num_requests):
        user, turn = (i // turns, i % turns) if turns > 1 else (i, 0)
        items.append(LoadItem(index=i, user=user, turn=turn, arrival=float(arrivals[user]) if turn == 0 else 0.0,
                              new_tokens=text.user_turn(int(p_lens[i]), system if turn == 0 else "")
                              if text is not None else rng.choice(pool, size=int(p_lens[i])).tolist(),
                              max_tokens=int(o_lens[i])))
    return prefix, items
