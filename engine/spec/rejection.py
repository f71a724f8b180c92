"""Lossless verification of draft tokens (speculative sampling, Leviathan et al. / Chen et al.).

Greedy requests: a draft token is accepted iff it equals the target's argmax at its position; the first
mismatch is replaced by the target's token; when all drafts pass, the target's next token is the bonus.

Sampled requests: draft x_j (drawn from the drafter's distribution q_j) is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection the token is resampled from normalize(max(0, p_j - q_j));
when all k drafts are accepted a bonus token is drawn from p_k. Every emitted token is then distributed
exactly as the target's p, whatever q is. Deterministic drafters (n-gram, greedy drafts) pass q=None:
q_j is one-hot at x_j, so acceptance is p_j(x_j) and the residual is p_j with x_j removed.
"""
from __future__ import annotations

import torch


def rejection_sample(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> list[int]:
    """p [k+1, V] target probabilities (already filtered: temperature, top-k/p, min-p); draft: k token ids;
    q [k, V] the distribution each draft was drawn from, or None for deterministic (one-hot) drafts.
    -> the emitted tokens: the accepted drafts then one corrected or bonus token (1..k+1 tokens)."""
    k = len(draft)
    dev = p.device
    if k:
        idx = torch.arange(k, device=dev)
        x = torch.tensor(draft, device=dev, dtype=torch.long)
        px = p[idx, x]
        u = torch.rand(k, device=dev, generator=generator, dtype=p.dtype)
        if q is None:
            ok = u < px                                    # min(1, p/1)
        else:
            qx = q[idx, x]
            ok = u * qx < px                               # u < p/q without dividing by a tiny q
        rejected = (~ok).nonzero()
        n_acc = int(rejected[0, 0]) if rejected.numel() else k
    else:
        n_acc = 0
    if n_acc == k:
        dist = p[k]
    else:
        if q is None:
            dist = p[n_acc].clone()
            dist[draft[n_acc]] = 0.0
        else:
            dist = (p[n_acc] - q[n_acc]).clamp_min_(0.0)
        if not bool(dist.sum() > 0):                       # p == q exactly: rejection had probability 0
            dist = p[n_acc]
    tok = int(torch.multinomial(dist, 1, generator=generator)[0])
    return list(draft[:n_acc]) + [tok]


def greedy_accept(target: list[int], draft: list[int]) -> list[int]:
    """target: the target's token at each of the k+1 verified positions; draft: k tokens."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return list(draft[:n]) + [target[n]]
