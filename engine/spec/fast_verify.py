"""The verify step's fast path: plain-greedy verification packed straight into the padded CUDA-graph layout.

When every scheduled request decodes (its last token + k_i <= k drafts) with plain greedy sampling (no
penalties, logprobs or min_tokens ban), no request is constrained and a verify graph covers the batch
(`EngineConfig.spec_fast_verify`), the step skips the general packing (ModelRunner.prepare) and the graph
runner's re-padding of it: the host writes the padded layout of cuda_graphs.py directly (sequence i's
q_i = k_i + 1 rows at i*Q .., its context extended by Q - q_i, padded rows in the null block) into two
persistent staging buffers, the graph runner copies them into its static buffers and replays, the device
takes the argmax of the B*Q real rows, and those B*Q ids are the one device->host copy the step waits for.
Acceptance then compares short host lists (Drafter.verify_greedy). The tokens are the general path's: the
same graph computes the same logits rows, and greedy verification only needs their argmax.
"""
from __future__ import annotations

import numpy as np
import torch

from .base import plain_greedy


class FastVerify:
    def __init__(self, engine):
        self.engine = engine
        self._h64 = self._h32 = self._targets = None    # host staging / result buffers (pinned on CUDA)
        self._staged = None         # CUDA event after the staging copies: set before the buffers are rewritten
        self._copied = None         # CUDA event after the targets' copy to the host
        self._n = 0                 # B * Q target ids of the launched step

    def plan(self, sched) -> tuple | None:
        """The verify graph key (P, Q, None) if this step can take the fast path, else None."""
        eng = self.engine
        g = eng.runner.graphs
        if g is None or eng.num_constrained or eng.runner.executor is not None or not eng.config.spec_fast_verify:
            return None
        ks = sched.num_spec_tokens
        kmax = max(ks, default=0)
        if not kmax:
            return None
        max_len = 0
        for seq, n, start, k in zip(sched.seqs, sched.num_new_tokens, sched.computed_before, ks):
            if n != k + 1 or start != seq.num_tokens - 1 or not seq.num_output_tokens or not plain_greedy(seq):
                return None
            if start + n > max_len:
                max_len = start + n
        key = g.spec_key(len(sched.seqs), kmax + 1, max_len)
        # a step whose forwards the runner samples for per-region timings runs eagerly (the general path)
        if key is None or eng.runner._timed_eagerly():
            return None
        return key

    def _buffers(self, n64: int, n32: int, n_targets: int):
        dev = self.engine.runner.device
        pin = dev.type == "cuda"
        if self._h64 is None or self._h64.numel() < n64:
            self._h64 = torch.empty(max(n64, 1024), dtype=torch.int64, pin_memory=pin)
        if self._h32 is None or self._h32.numel() < n32:
            self._h32 = torch.empty(max(n32, 1024), dtype=torch.int32, pin_memory=pin)
        if self._targets is None or self._targets.numel() < n_targets:
            self._targets = torch.empty(max(n_targets, 256), dtype=torch.int64, pin_memory=pin)
        if pin and self._staged is None:
            self._staged, self._copied = torch.cuda.Event(), torch.cuda.Event()

    @torch.inference_mode()
    def launch(self, sched, key: tuple) -> bool:
        """Pack, replay and start the argmax ids' copy to the host; -> whether a CUDA graph was replayed."""
        runner = self.engine.runner
        g, bs = runner.graphs, runner.block_size
        P, Q, _ = key
        seqs, ks = sched.seqs, sched.num_spec_tokens
        B, n = len(seqs), P * Q
        W = max(max(len(s.block_table) for s in seqs), -(-Q // bs))
        self._buffers(3 * n, P + P * W, B * Q)
        if self._staged is not None:
            self._staged.synchronize()          # the previous step's copies out of the staging buffers are done
        h64, h32 = self._h64.numpy()[:3 * n], self._h32.numpy()[:P + P * W]
        h64.fill(0)
        h32.fill(0)
        ids = h64[:n].reshape(P, Q)                                   # [P, Q]
        lens, tables = h32[:P], h32[P:].reshape(P, W)                 # [P], [P, W]
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            ids[i, 0] = seq.token_ids[-1]
            if k:
                ids[i, 1:k + 1] = seq.spec_token_ids[:k]
            tables[i, :len(seq.block_table)] = seq.block_table
        start = np.asarray(sched.computed_before, dtype=np.int64)     # [B]
        q = np.asarray(ks, dtype=np.int64) + 1                        # [B]
        j = np.arange(Q, dtype=np.int64)
        real = j[None, :] < q[:, None]                                # [B, Q]
        pos = np.where(real, start[:, None] + j[None, :], 0)          # [B, Q]; padded rows: position 0, slot 0
        blk = np.take_along_axis(tables[:B], pos // bs, axis=1)
        h64[n:n + B * Q] = pos.reshape(-1)
        h64[2 * n:2 * n + B * Q] = np.where(real, blk * bs + pos % bs, 0).reshape(-1)
        lens[:B] = start + Q                    # start + q_i, extended by Q - q_i
        lens[B:] = Q                            # padded sequences: Q rows in the null block
        lens_cpu = lens.tolist() if not g.use_graphs else None
        out = g.run_padded(key, self._h64[:3 * n], self._h32[:P + P * W], W, lens_cpu)    # [P*Q, V]
        if self._staged is not None:
            self._staged.record()
        targets = out[:B * Q].argmax(-1)                              # [B*Q]
        self._n = B * Q
        self._targets[:B * Q].copy_(targets, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return g.use_graphs

    def targets(self) -> list[int]:
        """Wait for the launched step (the step's one sync; the wait releases the GIL) -> its B*Q argmax ids."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._targets[:self._n].tolist()
