"""Sampler: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Seeded requests draw from a generator seeded by (seed, output position), so their tokens do not depend
on batch composition or preemption. Unseeded requests use the engine's generator.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.worker.host_copy import HostCopy
from engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

if TYPE_CHECKING:
    from engine.core.sequence import Sequence


_philox_rngs: dict[int, random.Random] = {}     # per engine seed: one Philox seed per fused draw


def _philox_seed(generator: torch.Generator | None) -> int:
    """Host-side seeds for the fused sampler, following the engine's seed without a device sync."""
    key = generator.initial_seed() if generator is not None else 0
    rng = _philox_rngs.get(key)
    if rng is None:
        rng = _philox_rngs[key] = random.Random(key)
    return rng.getrandbits(31)


def _to_dev(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a device tensor without a stream sync (multi-step launches must not wait)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass
class SampleRow:
    params: SamplingParams
    token_ids: list[int]        # prompt + output so far (penalties)
    num_prompt: int
    position: int               # output index of the token being sampled (seeds)
    banned: list[int] | None = None  # token ids masked out (EOS before min_tokens)


def _apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place on logits [B, V]: repetition / presence / frequency penalties, then every row's logit_bias
    (one scatter-add for the batch)."""
    bias_rows, bias_ids, bias_vals = [], [], []
    for i, r in enumerate(rows):
        p = r.params
        if not p.needs_penalties:
            continue
        if p.logit_bias:
            bias_rows += [i] * len(p.logit_bias)
            bias_ids += p.logit_bias.keys()
            bias_vals += p.logit_bias.values()
        row = logits[i]
        if p.repetition_penalty != 1.0 and r.token_ids:
            ids = torch.tensor(sorted(set(r.token_ids)), device=logits.device)
            vals = row[ids]
            row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        out = r.token_ids[r.num_prompt:]
        if out and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(out, device=logits.device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
    if bias_rows:
        dev = logits.device
        logits.index_put_((_to_dev(bias_rows, dev, torch.int64), _to_dev(bias_ids, dev, torch.int64)),
                          _to_dev(bias_vals, dev, logits.dtype), accumulate=True)


def filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks; returns probabilities [B, V]."""
    dev = logits.device
    temp = _to_dev([r.params.temperature for r in rows], dev, torch.float32).clamp_min(GREEDY_TEMPERATURE)
    logits = logits / temp[:, None]
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        V = logits.shape[-1]
        k = _to_dev([kk if 0 < kk < V else V for kk in top_k], dev)   # any k >= V: no cut
        ranks = torch.arange(V, device=dev)[None, :]
        mask = ranks >= k[:, None]
        probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(-1)
        cum = probs.cumsum(-1) - probs                      # mass strictly before each token
        mask |= cum >= _to_dev(top_p, dev, torch.float32)[:, None]
        mask[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    if any(m > 0 for m in min_p):
        mp = _to_dev(min_p, dev, torch.float32)[:, None]
        probs = probs.masked_fill(probs < mp * probs.max(-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + position) & 0x7FFF_FFFF_FFFF_FFFF)


def _sample_plain(logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool],
                  generator: torch.Generator | None, fused: bool = False) -> torch.Tensor:
    """Temperature only, no seeds: one batched draw from softmax(logits / T) per row, argmax for greedy rows.
    fused (Triton on CUDA): one Gumbel-max pass over the logits, True: its chunk winners reduced in torch,
    "one_launch": in the kernel (EngineConfig.sampler_one_launch); else an exponential race (same law)."""
    dev = logits.device
    if fused and dev.type == "cuda":
        from engine.kernels.sampling import gumbel_sample
        temp = _to_dev([0.0 if g else r.params.temperature for r, g in zip(rows, greedy)], dev, torch.float32)
        return gumbel_sample(logits, temp, _philox_seed(generator), one_launch=fused == "one_launch")
    temp = _to_dev([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)], dev, torch.float32)
    probs = (logits / temp[:, None]).softmax(-1)                       # [B, V]
    if dev.type == "cpu":                                              # cheaper than an exponential per entry
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    else:
        q = torch.empty_like(probs).exponential_(generator=generator)
        sampled = (probs / q).argmax(-1)
    if any(greedy):
        sampled = torch.where(_to_dev(greedy, dev), logits.argmax(-1), sampled)
    return sampled


def sample_unseeded(logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool],
                    generator: torch.Generator | None, fused: bool = False) -> torch.Tensor:
    """Rows without a seed (bans and penalties already applied) -> token ids [B] on the device, no host sync."""
    if all(greedy) and not (fused and logits.is_cuda):   # the fused kernel's argmax beats torch's at any size
        return logits.argmax(-1)
    if not any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0 for r in rows):
        return _sample_plain(logits, rows, greedy, generator, fused)
    tokens = logits.argmax(-1)
    sample_idx = [i for i, g in enumerate(greedy) if not g]
    probs = filtered_probs(logits[sample_idx], [rows[i] for i in sample_idx])  # [S, V]
    q = torch.empty_like(probs).exponential_(generator=generator)
    tokens[_to_dev(sample_idx, logits.device)] = (probs / q).argmax(-1)
    return tokens


def sample(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None = None,
           fused: bool = False) -> tuple[list[int], torch.Tensor | None]:
    """logits [B, V] float32 -> (token ids, raw log-probs [B, V] when any row asked for logprobs)."""
    tokens, raw_logprobs = sample_on_device(logits, rows, generator, fused)
    return HostCopy(tokens).tolist(), raw_logprobs


def sample_on_device(logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None = None,
                     fused: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sample` without the host sync: (token ids [B] int64 on the device, raw log-probs or None)."""
    want_logprobs = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = logits.log_softmax(-1) if want_logprobs else None
    if any(r.banned for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.banned:
                logits[i, r.banned] = float("-inf")
    if any(r.params.needs_penalties for r in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)
    seeded = [i for i, r in enumerate(rows) if r.params.seed is not None and not r.params.greedy]
    # unseeded rows (seeded ones ride along as greedy placeholders, overwritten below)
    tokens = sample_unseeded(logits, rows, [r.params.greedy or i in seeded for i, r in enumerate(rows)],
                             generator, fused)
    if seeded:
        probs = filtered_probs(logits[seeded], [rows[i] for i in seeded])   # [S, V]
        for j, i in enumerate(seeded):
            g = _seeded_generator(rows[i].params.seed, rows[i].position, probs.device)
            tokens[i] = torch.multinomial(probs[j], 1, generator=g)[0]
    return tokens, raw_logprobs


class Sampler:
    """The step's sampling stage: one SampleRow per sampled sequence, then one sampling call for the batch.
    fused: the Triton Gumbel-max sampler on CUDA (True, or "one_launch"); generator: unseeded draws."""

    def __init__(self, eos_token_ids: set[int], generator: torch.Generator, fused: bool | str = False):
        self.eos_token_ids, self.generator, self.fused = eos_token_ids, generator, fused

    def warmup(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        """Compile the fused sampler's variants for up to max_rows rows a step now, not mid-serving."""
        if self.fused and device.type == "cuda":
            from engine.kernels.sampling import warmup_gumbel
            warmup_gumbel(vocab_size, max_rows, device, one_launch=self.fused == "one_launch")

    def row(self, seq: "Sequence", extra_tokens: list[int] | None = None) -> SampleRow:
        """seq's next token's row; extra_tokens: drafts appended before it (a verify step's later positions)."""
        p = seq.params
        toks = seq.token_ids + extra_tokens if extra_tokens else seq.token_ids
        n_out = len(toks) - seq.num_prompt_tokens
        banned = None
        if n_out < p.min_tokens and seq.matcher is None:     # a grammar alone decides when it may end
            banned = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
        return SampleRow(p, toks if p.needs_penalties else [], seq.num_prompt_tokens, n_out, banned)

    def __call__(self, seqs: list["Sequence"], sample_mask: list[bool], logits: torch.Tensor
                 ) -> tuple[list[list[int]], list]:
        """logits [rows, V], one row per sequence whose mask is set -> (new tokens per sequence, logprob rows)."""
        rows = [self.row(seq) for seq, m in zip(seqs, sample_mask) if m]
        if not rows:
            return [[] for _ in seqs], [None] * len(seqs)
        tokens, logprobs = sample(logits, rows, self.generator, fused=self.fused)
        out_tokens, out_lp, j = [], [], 0
        for m in sample_mask:
            if m:
                out_tokens.append([tokens[j]])
                out_lp.append(None if logprobs is None else [logprobs[j]])
                j += 1
            else:
                out_tokens.append([])
                out_lp.append(None)
        return out_tokens, out_lp
