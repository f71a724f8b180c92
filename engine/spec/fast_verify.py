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

import torch

from engine.spec.base import plain_greedy


class FastVerify:
    def __init__(self, engine):
        self.engine = engine
        self.enabled = engine.config.speculative_config.spec_fast_verify
        self._cap = (0, 0, 0)       # capacities of the host buffers below (int64, int32, targets)
        self._h64 = self._h32 = self._targets = None    # host staging / result buffers (pinned on CUDA)
        self._n64 = self._n32 = None                    # their numpy views
        self._staged = None         # CUDA event after the staging copies: set before the buffers are rewritten
        self._copied = None         # CUDA event after the targets' copy to the host
        self._out: torch.Tensor | None = None           # the launched step's argmax ids (CPU: the result)

    def plan(self, sched) -> tuple | None:
        """The verify graph key (P, Q, None) if this step can take the fast path, else None."""
        eng = self.engine
        g = eng.runner.graphs
        if g is None or not self.enabled or eng.structured.num_constrained or eng.runner.executor is not None:
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

    def _buffers(self, n64: int, n32: int, n_targets: int) -> None:
        c64, c32, ct = self._cap
        if n64 <= c64 and n32 <= c32 and n_targets <= ct:
            return
        pin = self.engine.runner.device.type == "cuda"
        c64, c32, ct = max(n64, 2 * c64, 1024), max(n32, 2 * c32, 1024), max(n_targets, 2 * ct, 256)
        self._h64 = torch.zeros(c64, dtype=torch.int64, pin_memory=pin)
        self._h32 = torch.zeros(c32, dtype=torch.int32, pin_memory=pin)
        self._n64, self._n32 = self._h64.numpy(), self._h32.numpy()
        if pin:
            self._targets = torch.empty(ct, dtype=torch.int64, pin_memory=True)
            if self._staged is None:
                self._staged, self._copied = torch.cuda.Event(), torch.cuda.Event()
        self._cap = (c64, c32, ct)

    @torch.inference_mode()
    def launch(self, sched, key: tuple) -> bool:
        """Pack, replay and start the argmax ids' copy to the host; -> whether a CUDA graph was replayed.
        The batch is a few requests of at most k+1 rows: plain lists beat numpy's per-call cost here."""
        runner = self.engine.runner
        g, bs = runner.graphs, runner.block_size
        P, Q, _ = key
        seqs, ks = sched.seqs, sched.num_spec_tokens
        B, n = len(seqs), P * Q
        W = max(-(-Q // bs), max(len(s.block_table) for s in seqs))
        self._buffers(3 * n, P + P * W, B * Q)
        ids, pos, slots = [0] * n, [0] * n, [0] * n      # padded rows: token 0 at position 0, K/V to slot 0
        lens = [Q] * P                                      # padded sequences: Q rows in the null block
        tables = [0] * (P * W)
        for i, (seq, k, start) in enumerate(zip(seqs, ks, sched.computed_before)):
            r = i * Q
            ids[r] = seq.token_ids[-1]
            if k:
                ids[r + 1:r + k + 1] = seq.spec_token_ids[:k]
            bt = seq.block_table
            for j in range(k + 1):
                p = start + j
                pos[r + j] = p
                slots[r + j] = bt[p // bs] * bs + p % bs
            lens[i] = start + Q                 # start + q_i, extended by Q - q_i
            tables[i * W:i * W + len(bt)] = bt
        if self._staged is not None:
            self._staged.synchronize()          # the previous step's copies out of the staging buffers are done
        self._n64[:3 * n] = ids + pos + slots
        self._n32[:P] = lens
        self._n32[P:P + P * W] = tables
        out = g.run_padded(key, self._h64[:3 * n], self._h32[:P + P * W], W, lens)    # [P*Q, V]
        targets = out[:B * Q].argmax(-1)                              # [B*Q]
        if self._staged is not None:
            self._staged.record()
            self._out = self._targets[:B * Q]
            self._out.copy_(targets, non_blocking=True)
            self._copied.record()
        else:
            self._out = targets
        return g.use_graphs

    def targets(self) -> list[int]:
        """Wait for the launched step (the step's one sync; the wait releases the GIL) -> its B*Q argmax ids."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._out.tolist()
