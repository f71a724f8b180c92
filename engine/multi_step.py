"""Multi-step decoding (vLLM V0's `num_scheduler_steps`): when a step would be decode-only, run K decode
iterations back to back on the device and go back to the host once.

Each iteration's input ids are the previous iteration's sampled tokens, still on the device; positions,
slots and context lengths for all K iterations are packed once on the host ([K, B]) since the blocks for
K more tokens are allocated up front. Sampling stays on the device, so the host launches K forwards
(CUDA-graph replays on GPU) without a sync and then post-processes K tokens per request like a step
that accepted K speculative tokens: a request that stops early discards the rest.

It applies only where it cannot change results: no drafter, KV cache on, every running request decoding,
nothing waiting that could be admitted, and every request sampling "plainly" (greedy or temperature
only, unseeded, no penalties, logprobs or min_tokens ban). Otherwise the engine takes a normal step.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .kernels.metadata import AttentionMetadata
from .sampler import SampleRow, _sample_plain
from .scheduler import SchedulerOutput
from .sequence import Sequence


def _plain(seq: Sequence) -> bool:
    p = seq.params
    return (not p.needs_penalties and p.logprobs is None and seq.num_output_tokens >= p.min_tokens
            and (p.greedy or (p.seed is None and p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0)))


def plan(engine) -> int:
    """How many decode iterations the next step may run (1: take a normal step)."""
    K = engine.num_scheduler_steps
    sch = engine.scheduler
    if K <= 1 or engine.drafter is not None or not engine.config.enable_kv_cache or not sch.running:
        return 1
    if sch.waiting and len(sch.running) < engine.config.max_num_seqs:
        return 1                                    # admit the newcomers with a normal step
    if len(sch.running) > engine.config.max_num_batched_tokens:
        return 1
    room = engine.max_model_len
    for seq in sch.running:
        if seq.num_computed_tokens != seq.num_tokens - 1 or not _plain(seq):
            return 1
        room = min(room, engine.max_model_len - seq.num_tokens + 1)
    K = min(K, room)
    bm = engine.block_manager
    need = sum(bm.blocks_needed(s, s.num_computed_tokens + K) for s in sch.running)
    return K if K > 1 and need <= bm.pool.num_free else 1


def schedule(engine, K: int) -> SchedulerOutput:
    """Every running request computes K tokens (1 known + K - 1 sampled on the way); blocks taken now."""
    out = SchedulerOutput()
    for seq in engine.scheduler.running:
        engine.block_manager.allocate(seq, K)
        out.seqs.append(seq)
        out.num_new_tokens.append(K)
        out.num_spec_tokens.append(0)
        out.computed_before.append(seq.num_computed_tokens)
    return out


def prepare(runner, sched: SchedulerOutput, K: int) -> tuple[torch.Tensor, list[AttentionMetadata]]:
    """-> first iteration's input ids [B] and one metadata per iteration (views of [K, B] tensors)."""
    seqs, bs, dev = sched.seqs, runner.block_size, runner.device
    B = len(seqs)
    start = np.asarray(sched.computed_before, dtype=np.int64)                # [B]
    pos = start[None, :] + np.arange(K, dtype=np.int64)[:, None]              # [K, B]
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((B, width), dtype=np.int64)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    slots = np.take_along_axis(tables, (pos // bs).T, axis=1).T * bs + pos % bs   # [K, B]
    packed = np.concatenate([pos, slots, pos + 1]).astype(np.int64)          # [3K, B]
    packed_d = torch.from_numpy(packed).to(dev, non_blocking=True)
    pos_d, slots_d = packed_d[:K], packed_d[K:2 * K]
    lens_d = packed_d[2 * K:].to(torch.int32)
    tables_d = torch.from_numpy(tables.astype(np.int32)).to(dev, non_blocking=True)
    arange = torch.arange(B + 1, device=dev)
    cu_q, logits_idx = arange.to(torch.int32), arange[:B]
    mds = []
    for j in range(K):
        lens = (start + j + 1).tolist()
        mds.append(AttentionMetadata(
            positions=pos_d[j], slot_mapping=slots_d[j], cu_seqlens_q=cu_q, seq_lens=lens_d[j],
            block_tables=tables_d, logits_indices=logits_idx, q_lens=[1] * B, seq_lens_cpu=lens,
            max_seqlen_q=1, max_seqlen_k=max(lens), block_size=bs))
    ids = torch.tensor([s.token_ids[c] for s, c in zip(seqs, sched.computed_before)], dtype=torch.int64)
    return ids.to(dev, non_blocking=True), mds


def execute(engine, sched: SchedulerOutput, K: int) -> tuple[list[list[int]], float, float, bool]:
    """Run K iterations; -> (K tokens per request, time launches ended, time tokens arrived, graphed)."""
    rows = [SampleRow(s.params, [], s.num_prompt_tokens, s.num_output_tokens) for s in sched.seqs]
    greedy = [r.params.greedy for r in rows]
    fused = engine.kernels == "triton"
    ids, mds = prepare(engine.runner, sched, K)
    toks = []
    for md in mds:
        logits = engine.runner.execute(ids, md)                              # [B, V]
        ids = logits.argmax(-1) if all(greedy) and not fused else _sample_plain(logits, rows, greedy, engine.generator, fused)
        toks.append(ids)
    t_launched = time.perf_counter()
    out = torch.stack(toks, 1).tolist()                                      # [B, K]: the one sync
    return out, t_launched, time.perf_counter(), mds[0].graphed
