"""Multi-step decoding (vLLM V0's `num_scheduler_steps`): when a step would be decode-only, run K decode
iterations back to back on the device and go back to the host once.

Each iteration's input ids are the previous iteration's sampled tokens, still on the device; positions,
slots and context lengths for all K iterations are packed once on the host ([K, B]) since the blocks for
K more tokens are allocated up front. Sampling stays on the device, so the host launches K forwards
(CUDA-graph replays on GPU) without a sync and then post-processes K tokens per request like a step
that accepted K speculative tokens: a request that stops early discards the rest.

It applies only where it cannot change results: no drafter (or one with every request's drafting off and no
probe due within the block), KV cache on, every running request decoding, nothing waiting that could be
admitted, and every request sampling on the device alone (greedy, or unseeded temperature / top-k / top-p /
min-p; no penalties, logprobs or min_tokens ban). Otherwise the engine takes a normal step.

Newcomers that can be admitted (and sample as a block's rows do, without prompt logprobs) join behind the block
in flight: a mixed step is launched after it without a host sync, each running request decoding one token from
the block's last sampled one on the device and the newcomers' whole prompts prefilled beside them (vLLM's
scheduling of a step while the one before it runs). Its tokens are processed like a one-iteration block's, and
the next block (or, while newcomers still wait, the next mixed step) follows it. With nothing in flight, a mixed
step takes the running requests' ids from the host and computes the rest of any prompt a synchronous step chunked,
so that a burst is prefilled by mixed steps launched back to back, the GPU never waiting for the host between
them. Anything else that waits (a prompt longer than the step's budget, a swapped-out request, priority
scheduling) drains the pipeline for a synchronous step.

A batch with a constrained request (structured output) runs grammar blocks instead
(EngineConfig.structured_overlap): each token's mask needs the previous token on the host, but the next
forward does not. A block's first forward is launched from the in-flight block's tokens still on the
device; then the host waits for those tokens, advances the grammars (post-processing) and only then fills
the masks, masks and samples the launched logits, while the GPU runs that forward. Each later iteration
(EngineConfig.structured_multi_step) is launched from the tokens just sampled, while the host feeds those
tokens to the grammars and fills the next masks, with no scheduler or post-processing round trip per token.
Every earlier token is known on the host at sampling, so the tokens are those of one synced step per token;
a one-iteration block allows any sampling parameter but logprobs, a longer one none that needs the history
on the host (penalties, min_tokens).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.worker.host_copy import HostCopy
from engine.kernels.metadata import AttentionMetadata
from engine.sample.sampler import SampleRow, sample_on_device, sample_unseeded
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence
from engine.structured.block import feed_grammars


@dataclass
class InFlight:
    """A launched multi-step block whose tokens are still on the device."""
    sched: SchedulerOutput
    K: int
    tokens: torch.Tensor | None     # [B, K] int64 on the device (a grammar block: None until sampled)
    host: HostCopy | None           # the same tokens on their way to the host
    graphed: bool
    t_start: float
    t_scheduled: float
    t_launched: float
    logits: torch.Tensor | None = None     # a grammar block's [B, V] logits, launched and not yet sampled
    mask_s: float = 0.0                    # host seconds its masks took (filled and applied)
    mds: list[AttentionMetadata] | None = None     # a grammar block's iterations, launched one at a time
    advance: list[int] | None = None       # positions each request computes in it (None: K each; a mixed step's
                                           # newcomers: their prompts)
    began: torch.cuda.Event | None = None  # recorded on the GPU ahead of a decode block's first forward
    plan: dict | None = None               # why a decode block runs K iterations (MultiStepDecoder._time_cap)

    def extra(self, seqs: list[Sequence]) -> list[int]:
        """The positions in flight for each of seqs (those not in this block: none)."""
        adv = dict(zip(map(id, self.sched.seqs), self.advance or [self.K] * len(self.sched.seqs)))
        return [adv.get(id(s), 0) for s in seqs]


@dataclass
class BlockTokens:
    """A finished block's tokens on the host, for the engine's output processing."""
    sched: SchedulerOutput
    K: int
    tokens: list[list[int]]         # [B, K]
    graphed: bool
    t_start: float
    t_scheduled: float
    t_launched: float
    t_wait: float                   # the host began waiting for the tokens
    t_sample: float                 # they arrived
    mask_s: float                   # host seconds of grammar masks in this step
    plan: dict | None = None        # the block's length, and why (StepEvent.block_plan)


MixedPlan = tuple[list[Sequence], list[int], list[int]]   # (running requests, positions in flight, tokens computed)


def _fold(estimate: float | None, seconds: float) -> float:
    """A running estimate with `seconds` folded in, the recent weighing most."""
    return seconds if estimate is None else 0.5 * estimate + 0.5 * seconds


def _plain(seq: Sequence) -> bool:
    p = seq.params
    return (seq.matcher is None and not p.needs_penalties and p.logprobs is None
            and seq.num_output_tokens >= p.min_tokens and (p.greedy or p.seed is None))


def _in_grammar_block(seq: Sequence) -> bool:
    """Whether seq's rows can be sampled in a grammar block of several iterations, whose later iterations
    sample before the host has appended the tokens before them."""
    p = seq.params
    return p.logprobs is None and not p.needs_penalties and (seq.matcher is not None or
                                                             seq.num_output_tokens >= p.min_tokens)


def _in_flight(ahead: InFlight | None, seqs: list[Sequence]) -> list[int]:
    """Each of seqs' positions still in flight in `ahead` (none without a block ahead)."""
    return ahead.extra(seqs) if ahead else [0] * len(seqs)


def _admissible(seq: Sequence) -> bool:
    """Whether a waiting request's first token can be sampled on the device in a step launched behind another:
    as a block's rows (`_plain`), and no prompt logprobs."""
    return _plain(seq) and seq.prompt_logprobs is None


def _left(seq: Sequence, extra: int) -> int:
    """Tokens seq may still produce after the `extra` in flight (none: it ends within the block in flight)."""
    return seq.params.max_tokens - seq.num_output_tokens - extra


class MultiStepDecoder:
    """Plans, launches and pipelines decode blocks; the engine post-processes each block's tokens as one step.
    num_steps: iterations per block (EngineConfig.num_scheduler_steps, resolved); structured_overlap: batches
    with a constrained request run grammar blocks."""

    def __init__(self, config, scheduler, runner, sampler, structured, max_model_len: int, num_steps: int,
                 structured_overlap: bool):
        self.config, self.scheduler, self.runner = config, scheduler, runner
        self.sampler, self.structured = sampler, structured
        self.max_model_len, self.num_steps, self.structured_overlap = max_model_len, num_steps, structured_overlap
        self.drafter = None
        self.inflight: InFlight | None = None      # a launched block
        self.decode_iter_s: float | None = None    # measured seconds per decode iteration (multi_step_max_ms)
        self.host_round_s: float | None = None     # measured host seconds from one block's tokens to the launch
                                                   # of the block after the next (multi_step_max_ms)
        self._plan_note: dict | None = None        # the last _time_cap's reasons, for the block launched next
        self._last_block_done: float | None = None

    @property
    def enabled(self) -> bool:
        return self.num_steps > 1 or self.structured_overlap

    # ---- planning ------------------------------------------------------------------------------
    def plan(self, arrivals_pending: bool, ahead: InFlight | None = None, admit: bool = True) -> int:
        """How many decode iterations the next block may run (0: take a normal step). With `ahead`, the block
        would follow that in-flight one, whose K tokens per request are not known on the host yet. A batch
        with a constrained request gets a grammar block (with EngineConfig.structured_overlap) or 0.
        admit=False: as if no newcomer were waiting."""
        sch, sc = self.scheduler, self.config.scheduler_config
        self._plan_note = None
        grammar = self.structured.num_constrained > 0 and any(s.matcher is not None for s in sch.running)
        K = self.num_steps if not grammar or self.config.structured_output_config.structured_multi_step else 1
        if (not self.structured_overlap if grammar else K <= 1) or not self.config.cache_config.enable_kv_cache \
                or not sch.running:
            return 0
        if self.drafter is not None and self.drafter.blocks_fast_path(sch.running):
            return 0                                    # a request drafts (or probes) within the block
        if admit and self._admit_now(arrivals_pending):
            return 0                                    # admit the newcomers with a normal (or mixed) step
        if len(sch.running) > sc.max_num_batched_tokens:
            return 0
        extra = ahead.K if ahead else 0
        inflight = {id(s) for s in ahead.sched.seqs} if ahead else None
        room, longest = self.max_model_len, 0
        kept = self._block_seqs(extra)
        kept_ids = {id(s) for s in kept}
        for seq in sch.running:
            if inflight is not None:
                if id(seq) not in inflight:
                    return 0
            elif seq.num_computed_tokens != seq.num_tokens - 1:
                return 0
            if not (seq.params.logprobs is None if grammar else _plain(seq)):
                return 0                                # (a grammar block samples with the host up to date)
            if id(seq) not in kept_ids:
                continue                                # ends in the block in flight: it bounds nothing here
            if grammar and not _in_grammar_block(seq):
                K = 1
            room = min(room, self.max_model_len - (seq.num_tokens + extra) + 1)
            longest = max(longest, _left(seq, extra))
        if sc.multi_step_trim:                         # no iteration that every request would discard
            K = min(K, longest)
        # with newcomers at the door (or just let in), the budget alone: they wait for this block (and a grammar
        # block's iterations are paced by the host's masks, not hidden behind the GPU)
        calm = ahead is not None and ahead.advance is None and not sch.waiting and not arrivals_pending \
            and not grammar
        K = min(K, room, self._time_cap(host=calm)) if K > 1 else min(K, room)
        in_flight = _in_flight(ahead, kept)
        ok = K >= 1 and sch.can_schedule_block(kept, [e + K for e in in_flight])
        return K if ok else 0

    def _admit_now(self, arrivals_pending: bool) -> bool:
        """Break the decode pipeline for a normal (prefill) step when newcomers can be admitted: once
        `multi_step_admit_min` batch slots are free, or as many as there are newcomers. A prefill step runs
        eagerly and costs several decode iterations of host time, so while the batch is full, admitting a few
        requests per step instead of one each time a request finishes keeps the GPU busy."""
        sch, sc = self.scheduler, self.config.scheduler_config
        if sc.scheduling_policy == "priority" and sch.waiting and sch.running \
                and sch.waiting.peek().params.priority < sch.running[-1].params.priority:
            return True                     # a better request waits: a normal step lets the scheduler preempt
        free = sc.max_num_seqs - len(sch.running)
        if free <= 0 or not (sch.waiting or arrivals_pending) or (sc.scheduling == "static" and sch.running):
            return False                    # (static batching admits only into an empty batch)
        want = len(sch.waiting) + (1 if arrivals_pending else 0)
        need = sc.multi_step_admit_min if sc.multi_step_admit_min is not None else max(1, sc.max_num_seqs // 32)
        return free >= min(want, need)

    def _time_cap(self, host: bool = True) -> int:
        """Iterations that fit EngineConfig.multi_step_max_ms at the measured time per iteration: a block's
        tokens reach the clients together, so its length is the inter-token latency they see. With `host`, a
        block never runs fewer iterations than hide the host's round trip (post-processing the block before it,
        launching the next): with fewer, the GPU idles through every round trip and the clients wait longer,
        not less."""
        budget = self.config.scheduler_config.multi_step_max_ms
        if not budget:
            return self.num_steps
        if self.decode_iter_s is None:
            return 1                                    # a first block of one iteration measures it
        fit = int(budget / 1e3 / self.decode_iter_s)
        # Shorter iterations than the budget run at least two per block, or the GPU would idle through every
        # round trip however short.
        fit = fit if fit >= 2 else (1 if fit == 0 else 2)
        cover = math.ceil(self.host_round_s / self.decode_iter_s) if host and self.host_round_s else 1
        self._plan_note = dict(iteration_ms=1e3 * self.decode_iter_s, budget_iterations=fit,
                               host_round_ms=None if self.host_round_s is None else 1e3 * self.host_round_s,
                               cover_iterations=cover if host else None)
        return max(1, min(self.num_steps, max(fit, cover)))

    def observe_iteration(self, seconds: float) -> None:
        """Fold one decode iteration's measured time into the running estimate (recent batches weigh most)."""
        self.decode_iter_s = _fold(self.decode_iter_s, seconds)

    def observe_host_round(self, seconds: float) -> None:
        """Fold one host round trip (a block's tokens in hand -> the block after the next launched) into its
        running estimate."""
        self.host_round_s = _fold(self.host_round_s, seconds)

    def _block_seqs(self, extra: int) -> list[Sequence]:
        """The requests a block computes: with EngineConfig.multi_step_trim, not those ending in the block in
        flight."""
        trim = extra and self.config.scheduler_config.multi_step_trim
        return [s for s in self.scheduler.running if not trim or _left(s, extra) > 0]

    def drop_finished(self) -> None:
        """Forget an in-flight block whose every request has ended (aborts, stops)."""
        if self.inflight is not None and all(s.is_finished for s in self.inflight.sched.seqs):
            self.inflight = None

    # ---- launching -----------------------------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput, K: int) -> list[AttentionMetadata]:
        """One metadata per iteration (views of [K, B] tensors packed once on the host)."""
        runner = self.runner
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
        return mds

    def launch(self, K: int, ahead: InFlight | None = None, sample: bool = True) -> InFlight:
        """Schedule and launch K iterations without a host sync. After an in-flight block, the first input
        ids are that block's last sampled tokens, gathered on the device. A grammar block (a constrained
        request in the batch) launches its first forward only, sampled here or, with sample=False, by
        `_sample_grammar_block` once the tokens before it are on the host."""
        t0 = time.perf_counter()
        extra = ahead.K if ahead else 0
        seqs = self._block_seqs(extra)
        sched = self.scheduler.schedule_block(seqs, K, _in_flight(ahead, seqs))
        self.runner.swap_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in)   # evictions to the host tier
        t_sched = time.perf_counter()
        runner = self.runner
        dev = runner.device
        if ahead is None:
            ids = torch.tensor([s.token_ids[c] for s, c in zip(sched.seqs, sched.computed_before)],
                               dtype=torch.int64).to(dev, non_blocking=True)
        else:
            row = {id(s): i for i, s in enumerate(ahead.sched.seqs)}
            idx = torch.tensor([row[id(s)] for s in sched.seqs], dtype=torch.int64).to(dev, non_blocking=True)
            ids = ahead.tokens[:, -1].index_select(0, idx)
        mds = self._prepare(sched, K)
        if any(s.matcher is not None for s in sched.seqs):
            logits = runner.execute(ids, mds[0])                                # [B, V]
            blk = InFlight(sched, K, None, None, mds[0].graphed, t0, t_sched, time.perf_counter(), logits,
                           mds=mds)
            return self._sample_grammar_block(blk) if sample else blk
        rows = [SampleRow(s.params, [], s.num_prompt_tokens, s.num_output_tokens) for s in sched.seqs]
        greedy = [r.params.greedy for r in rows]
        began = torch.cuda.Event(enable_timing=True) if ids.is_cuda else None
        if began is not None:
            began.record()
        toks = []
        for md in mds:
            logits = runner.execute(ids, md)                                    # [B, V]
            ids = sample_unseeded(logits, rows, greedy, self.sampler.generator, self.sampler.fused)
            toks.append(ids)
        tokens = torch.stack(toks, 1)                                           # [B, K]
        return InFlight(sched, K, tokens, HostCopy(tokens, timed=began is not None), mds[0].graphed, t0, t_sched,
                        time.perf_counter(), began=began, plan=self._plan_note)

    def mixed_plan(self, arrivals_pending: bool, prev: InFlight | None = None) -> MixedPlan | None:
        """The running requests' part of a mixed step launched without a host sync, if newcomers can be admitted by
        one instead of by a synchronous step: the first waiting request samples on the device (see `_admissible`)
        and its whole prompt fits the step beside the running requests' tokens, which are decodes that could run
        another block behind `prev`, or, with nothing in flight, decodes and the rest of prompts whose first chunk a
        synchronous step computed (`_first_mixed`). -> (running requests, positions each has in flight, tokens each
        computes), or None: a synchronous step."""
        sch, sc = self.scheduler, self.config.scheduler_config
        if not (sch.waiting and self.drafter is None and self.structured.num_constrained == 0
                and sc.scheduling_policy != "priority" and _admissible(sch.waiting[0])
                and not sch.waiting[0].host_block_table and self._admit_now(arrivals_pending)):
            return None
        if prev is None:
            first_mixed = self._first_mixed()
            if first_mixed is None:
                return None
            seqs, todo = first_mixed
            extra = [0] * len(seqs)
        else:
            if prev.tokens is None or not self.plan(arrivals_pending, ahead=prev, admit=False):
                return None
            seqs = self._block_seqs(prev.K)
            extra, todo = prev.extra(seqs), [1] * len(seqs)
        first = sch.waiting[0]
        fits = first.num_tokens <= sc.max_num_batched_tokens - sum(todo) and sch.can_schedule_block(
            seqs + [first], [e + n for e, n in zip(extra, todo)] + [first.num_tokens])
        return (seqs, extra, todo) if fits else None

    def _first_mixed(self) -> tuple[list[Sequence], list[int]] | None:
        """With nothing in flight: the running requests and the tokens each computes in a mixed step (one for a
        decode, the rest of its prompt for a request a synchronous step prefilled in part), or None when one of
        them needs the host (not `_plain`, prompt logprobs) or multi-step decoding is off."""
        if self.num_steps <= 1 or not self.config.cache_config.enable_kv_cache:
            return None
        seqs = list(self.scheduler.running)
        todo = [s.num_tokens - s.num_computed_tokens for s in seqs]
        if any(n < 1 or not _admissible(s) for s, n in zip(seqs, todo)):
            return None
        return seqs, todo

    def launch_mixed(self, plan: MixedPlan, prev: InFlight | None = None) -> InFlight:
        """One step launched without a host sync (vLLM's mixed step, scheduled while the step before it runs), from
        `mixed_plan(..., prev)`: behind `prev` each running request decodes a token from prev's last sampled one,
        still on the device; with nothing in flight the running requests' ids are on the host. Newcomers' whole
        prompts are prefilled beside them."""
        t0 = time.perf_counter()
        seqs, extra, todo = plan
        sched = self.scheduler.schedule_mixed(seqs, extra, _admissible, todo)
        self.runner.swap_blocks(sched.blocks_to_swap_out, sched.blocks_to_swap_in)
        t_sched = time.perf_counter()
        for seq in sched.admitted:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = t_sched
        runner = self.runner
        nd = len(seqs) if prev is not None else 0                               # decodes whose ids are on the device
        input_ids, md = runner.prepare(sched, [True] * len(sched.seqs), in_flight=nd)
        if nd:
            row = {id(s): i for i, s in enumerate(prev.sched.seqs)}
            idx = torch.tensor([row[id(s)] for s in seqs], dtype=torch.int64).to(runner.device, non_blocking=True)
            input_ids[:nd] = prev.tokens[:, -1].index_select(0, idx)        # the decodes' ids: one each, first
        logits = runner.execute(input_ids, md)                                    # [B, V]
        rows = [SampleRow(s.params, [], s.num_prompt_tokens, s.num_output_tokens) for s in sched.seqs]
        tokens = sample_unseeded(logits, rows, [r.params.greedy for r in rows], self.sampler.generator,
                                 self.sampler.fused)[:, None]                    # [B, 1]
        return InFlight(sched, 1, tokens, HostCopy(tokens), md.graphed, t0, t_sched, time.perf_counter(),
                        advance=list(sched.num_new_tokens))

    def _sample_grammar_block(self, blk: InFlight) -> InFlight | None:
        """Mask and sample a grammar block's launched logits, with every token before them on the host: the
        rows of the requests still running, as a synced step of just those would (None: none is running).
        Then its later iterations: each forward is launched from the tokens just sampled, and while it runs the
        host waits for those tokens, feeds them to the grammars and fills the next masks."""
        seqs = blk.sched.seqs
        alive = [i for i, s in enumerate(seqs) if not s.is_finished]
        if not alive:
            return None
        dev = blk.logits.device
        idx = None if len(alive) == len(seqs) else torch.tensor(alive, dtype=torch.int64).to(dev, non_blocking=True)
        rows = [self.sampler.row(seqs[i]) for i in alive]
        first = [r.position for r in rows]
        toks, copy = [], None
        for j in range(blk.K):
            if copy is not None:
                host = copy.tolist()                                                      # [B]
                feed_grammars([seqs[i] for i in alive], [host[i] for i in alive])
            logits = blk.logits if idx is None else blk.logits.index_select(0, idx)      # [B', V]
            t = time.perf_counter()
            self.structured.apply([seqs[i] for i in alive], logits)
            blk.mask_s += time.perf_counter() - t
            tokens = self._sample_iteration(logits, rows, first, j, idx, len(seqs))     # [B]
            toks.append(tokens)
            if j + 1 < blk.K:
                copy = HostCopy(tokens)                 # queued before the next forward, so it lands first
                blk.logits = self.runner.execute(tokens, blk.mds[j + 1])
        blk.tokens, blk.logits, blk.mds = torch.stack(toks, 1), None, None                  # [B, K]
        blk.host = HostCopy(blk.tokens)
        return blk

    def _sample_iteration(self, logits: torch.Tensor, rows: list[SampleRow], first: list[int], j: int,
                          idx: torch.Tensor | None, B: int) -> torch.Tensor:
        """Sample iteration j of a grammar block from its masked logits [B', V] -> token ids [B] (rows of ended
        requests: 0, never read). rows: the block's SampleRows, first: their positions at its first iteration."""
        for r, p in zip(rows, first):                   # (seeds: the host has not appended this block's tokens)
            r.position = p + j
        tokens, _ = sample_on_device(logits, rows, self.sampler.generator, self.sampler.fused)     # [B']
        if idx is not None:
            tokens = torch.zeros(B, dtype=torch.int64, device=logits.device).index_copy_(0, idx, tokens)
        return tokens

    # ---- one engine step -----------------------------------------------------------------------
    def run(self, K: int, arrivals_pending: bool, mixed: MixedPlan | None = None) -> BlockTokens:
        """Launch the next block behind the in-flight one (or, with nothing in flight, a first block of K iterations
        or, K = 0, the mixed step `mixed` plans), then wait for the in-flight block's tokens. A grammar block
        launched here is masked and sampled by `finish` once the engine has post-processed these tokens."""
        mask_s = 0.0
        if self.inflight is None:
            self.inflight = self.launch(K) if K else self.launch_mixed(mixed)
            mask_s += self.inflight.mask_s
        prev, self.inflight = self.inflight, None
        K_next = self.plan(arrivals_pending, ahead=prev)
        if K_next:
            nxt = self.launch(K_next, ahead=prev, sample=False)
        else:
            plan = self.mixed_plan(arrivals_pending, prev)
            nxt = self.launch_mixed(plan, prev) if plan else None
        self.inflight = nxt
        if nxt is not None and nxt.began is not None and self._last_block_done is not None:
            self.observe_host_round(nxt.t_launched - self._last_block_done)     # (a GPU's blocks run behind it)
        t_wait = time.perf_counter()
        tokens = prev.host.tolist()                                          # [B, K]: the one sync
        if self.runner.executor is not None:
            self.runner.executor.check()        # a rank that died mid-block leaves these tokens meaningless
        t_sample = time.perf_counter()
        # the device ran this block from its launch, or from the end of the block before it when it was queued
        # behind that one
        start = prev.t_scheduled
        if self._last_block_done is not None and prev.t_launched < self._last_block_done:
            start = self._last_block_done
        wall_s = (t_sample - start) / prev.K    # (behind a slow host: the host's round trip per iteration)
        if prev.advance is None:                # (a mixed step's prefill is no decode iteration)
            gpu = prev.began is not None
            self.observe_iteration(prev.began.elapsed_time(prev.host.event) / 1e3 / prev.K if gpu else wall_s)
        if self.drafter is not None:            # auto-off: the plain decode iteration it compares against
            self.drafter.observe_step(len(prev.sched.seqs), 0, wall_s)
        self._last_block_done = t_sample if nxt is not None else None
        return BlockTokens(prev.sched, prev.K, tokens, prev.graphed, prev.t_start, prev.t_scheduled,
                           prev.t_launched, t_wait, t_sample, mask_s, prev.plan)

    def finish(self) -> float:
        """After post-processing: sample a grammar block launched by `run` -> host seconds of its masks."""
        nxt = self.inflight
        if nxt is None or nxt.tokens is not None:
            return 0.0
        self.inflight = self._sample_grammar_block(nxt)
        return nxt.mask_s
