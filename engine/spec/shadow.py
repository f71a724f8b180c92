"""Auto-off's shadow probes (EngineConfig.spec_shadow_probes), a mixin of Drafter: a request whose drafting is
off is probed from its own output, inside multi-step blocks, instead of by a verify step."""
from __future__ import annotations

from engine.core.sequence import Sequence
from engine.spec.stats import PROBE_FIRST, expected_tokens


class ShadowProbes:
    @property
    def _shadowing(self) -> bool:
        return self.shadow_probes and self.auto_off

    def shadow_probe(self, seqs: list[Sequence]) -> None:
        """Auto-off with shadow probes (EngineConfig.spec_shadow_probes): after a step's tokens are appended,
        each request whose drafting is off and whose probe is due gets its probe from its own output instead of
        a verify step: the draft the proposer would have made at a history length L (the first one from the due
        position at which it finds one, with k tokens known after it) is compared with the tokens the target
        produced from L on. For greedy requests that count is exactly what verification would have accepted;
        for sampled ones it has the same distribution (a one-hot draft is accepted with the target's
        probability of that token). So a probe never leaves the multi-step pipeline, and a position where the
        proposer finds nothing costs a few dict lookups. The estimate and the switch back on follow a real
        probe's; the counters go to `self.shadow`, not to the drafts' (nothing was drafted)."""
        if not self._shadowing:
            return
        k, batch = self.k_base, None
        window = min(k, self.engine.num_scheduler_steps)        # tokens since the due position, at least
        for seq in seqs:
            st = self._accept.get(seq.request_id)
            if st is None or not st.off or st.first or seq.is_finished:
                continue
            n_out = seq.num_output_tokens
            lo = max(st.next_probe, 1)
            if n_out - lo < window:
                continue
            # replay drafting over the tokens since: a draft at each position the previous verify would have
            # reached (a rejected or absent draft: one token on), counted as if verified
            P, toks, pos, seen = seq.num_prompt_tokens, seq.token_ids, lo, 0
            num = den = 0                               # this replay's own acceptance (spec_shadow_confirm)
            while pos < n_out:
                found = self.shadow_draft(seq, P + pos, P + n_out - 1, k)
                if found is None:
                    break
                L, drafts = found
                drafts = drafts[:len(toks) - L]         # compared with the tokens known after L (at least one)
                a = 0
                while a < len(drafts) and drafts[a] == toks[L + a]:
                    a += 1
                self.shadow.add(len(drafts), a)
                st.update(len(drafts), a)
                num, den = num + a, den + a + (a < len(drafts))
                seen += 1
                pos = L - P + a + 1
            pending, st.pending = st.pending, False
            if not seen:
                st.next_probe = n_out                   # nothing to compare yet: continue from there
                continue                                # (pending: the proposer found nothing, not confirmed)
            if batch is None:
                running = [s for s in self.engine.scheduler.running if s.num_output_tokens]
                batch = max(1, len(running))
                on = [self._accept.get(s.request_id) for s in running]
                gain_on = sum(expected_tokens(a.rate, k) - 1 for a in on if a is not None and not a.off)
            self._after_verify(seq, st, batch)
            if pending and not st.off and expected_tokens(num / den, k) - 1 < self.cost_ratio(batch, k) - 1:
                self._switch_off(seq, st)               # this block's replays alone would not pay: stay off
            if self.every_block and st.off:        # replay again after the next block, from where this one ended
                st.next_probe, st.gap = pos, PROBE_FIRST
            if not st.off:
                # as the step's check (_pays) would: drafting only pays if the drafting requests' summed gain
                # beats the extra cost every decoding request pays; otherwise stay off (no pipeline break)
                gain = expected_tokens(st.rate, k) - 1
                if gain_on + gain < batch * (self.cost_ratio(batch, k) - 1):
                    st.off = True
                    self._switch_off(seq, st)
                else:
                    gain_on += gain
                    if self.confirm and not pending:
                        # on only if the replay of the block now in flight agrees: that block returns before any
                        # draft could run, so waiting for it adds no lag, and a chance run of matches costs a
                        # pipeline restart instead of verify steps
                        st.off, st.pending, st.next_probe = True, True, pos

    def shadow_draft(self, seq: Sequence, lo: int, hi: int, k: int) -> tuple[int, list[int]] | None:
        """(L, draft): the first history length L in [lo, hi] at which this drafter would have drafted, and that
        draft (drafters with supports_shadow)."""
        raise NotImplementedError
