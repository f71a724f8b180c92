"""The drafter interface the engine calls, and what every method shares: verification and metrics.

Per step the engine calls
  propose(running)              before scheduling: sets `seq.spec_token_ids` for requests in decode phase;
  verify(sched, mask, logits)   instead of sampling: the target's logits at the last num_spec+1 positions
                                of each sampled request -> tokens to append (accepted drafts + 1);
  accept(seq, num_spec, toks)   in postprocess: accepted drafts' KV is valid (computed += accepted),
                                rejected slots are dropped and blocks that only held them returned;
  pop_step_stats()              the step's counters for StepEvent.spec (totals, per position, per request);
  total_stats()                 cumulative counters for engine.stats().
Metrics follow vLLM: acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts.

Each request keeps a decayed estimate of its per-token acceptance probability a.

Auto-off (`EngineConfig.speculative_auto_off`, on by default): drafting stops for a request while its expected
gain, E[tokens per verify] - 1 = a + a^2 + ... + a^k, is below the measured extra cost of a verify step,
r - 1 with r = (seconds of a verify step with k drafts, drafting included) / (seconds of a plain decode
iteration) at the same batch size (before both are measured: 1 + k * (draft_cost + verify_cost)). A batch drafts
only while the drafting requests' summed gain exceeds the extra cost every request of the batch pays.
A request whose drafting is off is re-probed with k drafts after 16 more output tokens, the gap doubling after
each failed probe up to 256, so text that turns repetitive turns drafting back on. While no running request
drafts (or is due for a probe), steps are plain decode steps: CUDA graphs and multi-step decoding apply.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.sample.sampler import _apply_penalties, _seeded_generator, filtered_probs
from engine.core.sequence import Sequence
from engine.spec.rejection import greedy_accept, rejection_sample
from engine.spec.shadow import ShadowProbes
from engine.spec.stats import PROBE_FIRST, SpecStats, acceptance_rate, expected_tokens, mean_acceptance_length

_MAX_REQUEST_STATS = 4096
_DECAY = 0.8                 # weight of the past in the acceptance estimate
_PROBE_FIRST = PROBE_FIRST  # auto-off: output tokens before a request whose drafting is off is probed
_PROBE_MAX = 256             # auto-off: the probe gap doubles after each failed probe, up to this
_COST_DECAY = 0.7            # auto-off: weight of the past in the measured step times


class _Accept:
    """Decayed truncated-geometric estimate of a request's per-token acceptance probability."""
    __slots__ = ("num", "den", "off", "next_probe", "gap", "verified", "first", "klen", "pending")

    def __init__(self, klen: int = 0):
        self.num, self.den = 1.0, 2.0                   # prior: a = 0.5
        # auto-off: a request's first draft is a probe, its own acceptance decides (failed: gap to _PROBE_FIRST)
        self.off, self.next_probe, self.gap = True, 0, _PROBE_FIRST // 2
        self.verified = False
        self.first = True           # shadow probes: the first probe is still a real one (drafted and verified)
        self.klen = klen            # long drafts: this request's current draft length cap
        self.pending = False        # shadow confirm: a replay turned drafting on, the next block's must agree

    @property
    def rate(self) -> float:
        return self.num / self.den

    def update(self, k: int, accepted: int) -> None:
        self.num = _DECAY * self.num + accepted
        self.den = _DECAY * self.den + accepted + (accepted < k)


def _batch_bucket(b: int) -> int:
    return max(1, b).bit_length()          # 1, 2-3, 4-7, 8-15, ...


def plain_greedy(seq: Sequence) -> bool:
    p = seq.params
    return p.greedy and not p.needs_penalties and p.logprobs is None and seq.num_output_tokens >= p.min_tokens


class Drafter(ShadowProbes):
    method = "base"
    draft_cost = 0.0            # one draft token's work relative to one target decode step
    verify_cost = 0.05          # extra work of verifying one more position
    supports_shadow = False     # shadow_draft: the draft it would have made at an earlier history length
    supports_long = False       # drafts longer than num_speculative_tokens pay (free drafts: n-gram)

    def __init__(self, engine):
        self.engine = engine
        cfg = engine.config
        # long drafts (EngineConfig.num_speculative_tokens_max): a request whose last verify accepted every one of
        # its k_i drafts may draft 2 k_i next time, up to k_max; a rejection brings it back to k_base
        self.k_base = cfg.speculative_config.num_speculative_tokens
        self.k = max(self.k_base, cfg.speculative_config.num_speculative_tokens_max or 0) if self.supports_long \
            else self.k_base
        self.auto_off = engine.config.speculative_config.speculative_auto_off
        self.shadow_probes = engine.config.speculative_config.spec_shadow_probes and self.supports_shadow
        self.every_block = cfg.speculative_config.spec_shadow_every_block  # shadow replays after every block (no gap)
        self.confirm = cfg.speculative_config.spec_shadow_confirm          # a replay's switch on waits for the next one's
        self.shadow = SpecStats(self.k)         # shadow probes' drafts and how many would have been accepted
        self._accept: dict[str, _Accept] = {}
        self._t_plain: dict[int, float] = {}               # batch bucket -> s per plain decode iteration
        self._t_verify: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> s per verify step
        self._num_off = self._num_decoding = 0             # this step's propose: requests with drafting off
        self.total = SpecStats(self.k)
        self._step: SpecStats | None = None
        self._step_requests: dict[str, tuple[int, int]] = {}     # this step: request id -> (drafted, accepted)
        self._requests: OrderedDict[str, SpecStats] = OrderedDict()
        self._q: dict[str, torch.Tensor] = {}      # request id -> [k, V] draft distributions (sampled drafts)

    # ---- proposing -----------------------------------------------------------------------------
    def num_draft_slots(self, seq: Sequence) -> int:
        """How many drafts this request may get now: 0 unless it is decoding; never past max_tokens or
        max_model_len (the bonus token included), so a verified step can never overrun a limit."""
        if seq.is_finished or seq.num_output_tokens == 0 or seq.num_computed_tokens != seq.num_tokens - 1:
            return 0
        if seq.matcher is not None:     # constrained requests are not drafted for (their mask is per token)
            return 0
        room = min(seq.params.max_tokens - seq.num_output_tokens,
                   self.engine.max_model_len - seq.num_tokens) - 1
        k = max(0, min(self.k, room))
        if self.k > self.k_base and k > self.k_base:
            k = min(k, self._state(seq).klen)
        if self.auto_off and k > 0:
            st = self._state(seq)
            if st.off and (seq.num_output_tokens < st.next_probe or (self._shadowing and not st.first)):
                return 0
        return k

    def _state(self, seq: Sequence) -> _Accept:
        st = self._accept.get(seq.request_id)
        if st is None:
            st = self._accept[seq.request_id] = _Accept(self.k_base)
        return st

    def propose(self, running: list[Sequence]) -> None:
        cands = []
        if len(self._accept) > 2 * len(running) + 256:
            live = {s.request_id for s in running}
            self._accept = {r: a for r, a in self._accept.items() if r in live}
        for seq in running:
            seq.spec_token_ids = []                    # drafts of a step that never ran are stale
            self._q.pop(seq.request_id, None)
            k = self.num_draft_slots(seq)
            if k > 0:
                cands.append((seq, k))
        if self.auto_off:
            cands = self._pays(running, cands)
        if cands:
            timer = self.engine.runner.timer
            with timer.region("draft"):
                self.draft(cands)
            if self.auto_off and self._shadowing and not any(seq.spec_token_ids for seq, _ in cands):
                # drafting is on but nothing was drafted: the step is a synced plain step, which costs what a
                # verify step whose drafts were all rejected does (a multi-step block would have been cheaper),
                # so it counts as one for the estimate of each request whose drafting was on
                batch = max(1, self._num_decoding)
                for seq, k in cands:
                    st = self._accept[seq.request_id]
                    if not st.off:
                        st.update(k, 0)
                        self._after_verify(seq, st, batch)
            if self.auto_off:
                for seq, _ in cands:
                    st = self._accept[seq.request_id]
                    if st.off and not seq.spec_token_ids:      # a probe that found nothing: retry later
                        if self._shadowing and self.engine.num_scheduler_steps > 1:
                            # in the shadow from this position on: a real probe would break the pipeline
                            # (without multi-step a real retry costs nothing extra and reacts a step sooner)
                            st.first, st.next_probe = False, seq.num_output_tokens
                            continue
                        # unverified: after one multi-step block's worth of tokens (1 where there is no
                        # multi-step), so a request the proposer has nothing for never holds the batch off it
                        st.next_probe = seq.num_output_tokens + (st.gap if st.verified
                                                                 else self.engine.num_scheduler_steps)

    # ---- auto-off ------------------------------------------------------------------------------
    def cost_ratio(self, batch: int, k: int) -> float:
        """Seconds of a verify step with k drafts (drafting included) over a plain decode iteration, at this
        batch size; the static model until both are measured."""
        prior = 1.0 + k * (self.draft_cost + self.verify_cost)
        b = _batch_bucket(batch)
        tp, tv = self._t_plain.get(b), self._t_verify.get((b, k))
        if tp is None or tv is None:
            return prior
        return min(max(tv / tp, 1.0), (k + 1) * (1.0 + self.draft_cost))

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A decode-only step of `batch` requests took `seconds`: a plain iteration (k = 0, multi-step blocks
        report seconds per iteration) or a verify step whose longest draft was k (drafting included)."""
        if seconds <= 0:
            return
        b = _batch_bucket(batch)
        table, key = (self._t_plain, b) if k == 0 else (self._t_verify, (b, k))
        old = table.get(key)
        table[key] = seconds if old is None else _COST_DECAY * old + (1 - _COST_DECAY) * seconds

    def _pays(self, running: list[Sequence], cands: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Keep the step's drafts only if the drafting requests' expected gain beats the extra cost of the verify
        step, which every decoding request pays; otherwise drafting goes off for them until their next probe.
        Probes (requests whose drafting was off) always draft."""
        decoding = [s for s in running if s.num_output_tokens]       # past their prefill
        self._num_decoding = len(decoding)
        if cands and not any(self._accept[s.request_id].off for s, _ in cands):
            k = max(k for _, k in cands)
            gain = sum(expected_tokens(self._accept[s.request_id].rate, k) - 1 for s, _ in cands)
            if gain < len(decoding) * (self.cost_ratio(len(decoding), k) - 1):
                for s, _ in cands:
                    self._switch_off(s, self._accept[s.request_id])
                cands = []
        drafting = {id(s) for s, _ in cands}               # probes included
        self._num_off = sum(1 for s in decoding if id(s) not in drafting
                            and (st := self._accept.get(s.request_id)) is not None and st.off)
        return cands

    def _switch_off(self, seq: Sequence, st: _Accept) -> None:
        if self.every_block and self._shadowing and not st.first:      # shadow probes are free: no gap, backoff
            st.off, st.next_probe = True, seq.num_output_tokens
            return
        if st.off:                                      # a failed probe: wait longer next time
            st.gap = min(2 * st.gap, _PROBE_MAX)
        st.off, st.next_probe = True, seq.num_output_tokens + st.gap

    def _after_verify(self, seq: Sequence, st: _Accept, batch: int) -> None:
        """Auto-off: turn drafting off for a request whose expected gain no longer pays for the verify step
        (even if it were the only one drafting), or back on after a probe that paid."""
        st.verified = True
        k = self.k_base
        if expected_tokens(st.rate, k) - 1 >= self.cost_ratio(batch, k) - 1:
            st.off, st.gap = False, _PROBE_FIRST
        else:
            self._switch_off(seq, st)

    def blocks_fast_path(self, running: list[Sequence]) -> bool:
        """Whether a running request drafts (or probes) now, so multi-step decoding must wait: always without
        auto-off; with it, unless every request's drafting is off and no probe is due. A probe that falls due
        inside a block runs after it (at most num_scheduler_steps tokens late)."""
        if not self.auto_off:
            return True
        shadow = self._shadowing           # (probes after the first run in the shadow: never due here)
        for seq in running:
            st = self._accept.get(seq.request_id)
            if st is None or not st.off or st.pending or \
                    ((st.first or not shadow) and seq.num_output_tokens >= st.next_probe):
                return True
        return False

    def prefetch(self, sched) -> None:
        """Host work a first proposal needs, done while a prefill's forward runs (n-gram: the prompt's index)."""

    def draft(self, cands: list[tuple[Sequence, int]]) -> None:
        """Set seq.spec_token_ids (at most k tokens) for each (seq, k); optionally self._q[rid]."""
        raise NotImplementedError

    # ---- verification --------------------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, sched, sample_mask: list[bool], logits: torch.Tensor):
        eng = self.engine
        rows, groups = [], []
        r = 0
        # plain greedy rows (no penalties, logprobs or min_tokens ban) need only the argmax: no SampleRow per row
        plain = all(plain_greedy(seq) for seq, m in zip(sched.seqs, sample_mask) if m)
        for i, (seq, m) in enumerate(zip(sched.seqs, sample_mask)):
            if not m:
                continue
            k = sched.num_spec_tokens[i]
            drafts = list(seq.spec_token_ids[:k])
            if not plain:
                for j in range(k + 1):
                    rows.append(eng.sampler.row(seq, drafts[:j]))
            groups.append((i, seq, drafts, r))
            r += k + 1
        new_tokens: list[list[int]] = [[] for _ in sched.seqs]
        lp_rows: list = [None] * len(sched.seqs)
        self._step, self._step_requests = SpecStats(self.k), {}
        if not groups:
            return new_tokens, lp_rows
        assert r == logits.shape[0], f"verify: {r} logit rows expected, got {logits.shape[0]}"
        want_lp = any(rw.params.logprobs is not None for rw in rows)
        raw_lp = logits.log_softmax(-1) if want_lp else None
        if any(rw.banned for rw in rows) or any(rw.params.needs_penalties for rw in rows):
            logits = logits.clone()
            for j, rw in enumerate(rows):
                if rw.banned:
                    logits[j, rw.banned] = float("-inf")
            _apply_penalties(logits, rows)
        argmax = logits.argmax(-1).tolist()
        sampled = [j for j, rw in enumerate(rows) if not rw.params.greedy]
        probs, where = None, {}
        if sampled:
            probs = filtered_probs(logits[sampled], [rows[j] for j in sampled])
            where = {j: n for n, j in enumerate(sampled)}
        for i, seq, drafts, r0 in groups:
            k = len(drafts)
            p = seq.params
            if p.greedy:
                toks = greedy_accept(argmax[r0:r0 + k + 1], drafts)
            else:
                pr = probs[where[r0]:where[r0] + k + 1]
                q = self._q.pop(seq.request_id, None)
                if q is not None:
                    q = q[:k]
                gen = eng.sampler.generator if p.seed is None else \
                    _seeded_generator(p.seed, seq.num_output_tokens, pr.device)
                toks = rejection_sample(pr, drafts, q, gen)
            new_tokens[i] = toks
            if raw_lp is not None:
                lp_rows[i] = [raw_lp[r0 + j] for j in range(len(toks))]
            self._record(seq, k, len(toks) - 1, len(groups))
        return new_tokens, lp_rows

    def verify_greedy(self, sched, targets: list[int], Q: int):
        """Verification on the fast path (spec/fast_verify.py), where every scheduled request decodes plain
        greedy: targets[i * Q + j] is the target's argmax at request i's j-th verified position."""
        self._step, self._step_requests = SpecStats(self.k), {}
        B = len(sched.seqs)
        new_tokens = []
        for i, (seq, k) in enumerate(zip(sched.seqs, sched.num_spec_tokens)):
            toks = greedy_accept(targets[i * Q:i * Q + k + 1], seq.spec_token_ids[:k])
            new_tokens.append(toks)
            self._record(seq, k, len(toks) - 1, B)
        return new_tokens, [None] * B

    def _record(self, seq: Sequence, k: int, a: int, batch: int) -> None:
        """Count a verified request's k drafts of which a were accepted: step, total and per-request counters,
        the auto-off estimate."""
        self._step.add(k, a)
        self.total.add(k, a)
        if not k:
            return
        if self.auto_off or self.k > self.k_base:
            st = self._accept.get(seq.request_id)
            if st is not None:
                st.first = False
                st.update(k, a)
                if self.k > self.k_base:        # long drafts: grow after a draft accepted whole, else reset
                    st.klen = min(2 * st.klen, self.k) if a == k >= st.klen else \
                        (st.klen if a == k else self.k_base)
                if self.auto_off:
                    self._after_verify(seq, st, batch)
        self._step_requests[seq.request_id] = (k, a)
        rs = self._requests.get(seq.request_id)
        if rs is None:
            rs = self._requests[seq.request_id] = SpecStats(self.k)
            if len(self._requests) > _MAX_REQUEST_STATS:
                self._requests.popitem(last=False)     # least recently drafted for
        else:
            self._requests.move_to_end(seq.request_id)
        rs.add(k, a)

    def accept(self, seq: Sequence, num_spec: int, toks: list[int]) -> None:
        """After verification (before the tokens are appended): the KV of the accepted drafts is valid."""
        if not num_spec and len(toks) > 1:
            return          # a multi-step block (auto-off): its K tokens are all computed, the next block in flight
        seq.num_computed_tokens += len(toks) - 1
        seq.spec_token_ids = []
        # blocks beyond the last token's slot only hold rejected drafts (or unused draft slots)
        self.engine.block_manager.trim(seq, seq.num_computed_tokens + 1)

    # ---- metrics -------------------------------------------------------------------------------
    def pop_step_stats(self) -> dict | None:
        """The step's counters for StepEvent.spec, with vLLM's derived rates and, per verified request,
        its draft length and accepted count (`requests`: {request_id: [num_draft_tokens, num_accepted]})."""
        s, self._step = self._step, None
        reqs, self._step_requests = self._step_requests, {}
        if s is None:
            if not self.auto_off:
                return None
            s = SpecStats(self.k)           # a plain step: drafting was off (or found nothing) for everyone
        return dict(num_drafts=s.num_drafts, num_draft_tokens=s.num_draft_tokens,
                    num_accepted_tokens=s.num_accepted_tokens, accepted_per_pos=list(s.accepted_per_pos),
                    acceptance_rate=acceptance_rate(s.num_accepted_tokens, s.num_draft_tokens),
                    mean_acceptance_length=mean_acceptance_length(s.num_accepted_tokens, s.num_drafts),
                    requests={r: [k, a] for r, (k, a) in reqs.items()},
                    num_off=self._num_off, num_decoding=self._num_decoding)

    def total_stats(self) -> dict:
        t = self.total
        return dict(spec_method=self.method, num_speculative_tokens=self.k_base, max_speculative_tokens=self.k,
                    spec_decode_num_drafts=t.num_drafts, spec_decode_num_draft_tokens=t.num_draft_tokens,
                    spec_decode_num_accepted_tokens=t.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(t.accepted_per_pos),
                    acceptance_rate=acceptance_rate(t.num_accepted_tokens, t.num_draft_tokens),
                    mean_acceptance_length=mean_acceptance_length(t.num_accepted_tokens, t.num_drafts),
                    spec_shadow_probes=self.shadow.num_drafts, spec_shadow_draft_tokens=self.shadow.num_draft_tokens,
                    spec_shadow_accepted_tokens=self.shadow.num_accepted_tokens)

    def request_stats(self, request_id: str) -> dict | None:
        """Per-request counters (kept for the last few thousand requests that were ever drafted for)."""
        s = self._requests.get(request_id)
        return None if s is None else s.to_dict()
