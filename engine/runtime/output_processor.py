"""Output processing: a step's sampled tokens -> sequences (stop conditions, detokenization, logprobs, finishing
and block commits) -> RequestOutputs."""
from __future__ import annotations

import time

import torch

from engine.runtime.detokenizer import check_stop_strings, streamable_len
from engine.outputs import Logprob, RequestOutput
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


class OutputProcessor:
    def __init__(self, scheduler, block_manager, detok, eos_token_ids: set[int], max_model_len: int,
                 enable_kv_cache: bool):
        self.scheduler, self.block_manager, self.detok = scheduler, block_manager, detok
        self.eos_token_ids, self.max_model_len, self.enable_kv_cache = eos_token_ids, max_model_len, enable_kv_cache
        self.drafter = None                    # spec.Drafter: accepted drafts' KV and blocks
        self.final_outputs_only = False        # LLM.generate: skip building per-step streaming outputs
        self.delta_outputs = False             # the engine process: outputs carry this step's tokens and text
        #                                        alone (vLLM's RequestOutputKind.DELTA); its clients accumulate
        self.num_generation_tokens = 0

    def process(self, sched: SchedulerOutput, new_tokens: list[list[int]], lp_rows: list
                ) -> tuple[list[RequestOutput], list[Sequence], list[Sequence]]:
        """Append each scheduled sequence's new tokens -> (outputs, sequences that got their first token,
        sequences that finished: the scheduler has freed their blocks)."""
        now = time.perf_counter()
        outputs, first, finished = [], [], []
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            if seq.is_finished:  # aborted meanwhile
                continue
            seq.num_computed_tokens += n - sched.num_spec_tokens[i]
            toks = new_tokens[i]
            if not toks:
                self.block_manager.commit_computed(seq)
                continue
            if self.drafter is not None:
                self.drafter.accept(seq, sched.num_spec_tokens[i], toks)
            m = seq.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                first.append(seq)
            m.last_token_time = now
            m.token_times.append(now)
            added = []
            stop_str = None
            per_token = len(toks) > 1 and bool(seq.params.stop)   # find the token that completes a stop string
            for t_i, tok in enumerate(toks):
                seq.append_token(tok)
                added.append(tok)
                self.num_generation_tokens += 1
                if seq.logprobs is not None and lp_rows[i] is not None:
                    seq.logprobs.append(self._logprob_entry(lp_rows[i][t_i], tok, seq.params.logprobs))
                reason = self._check_stop_token(seq, tok)
                if seq.matcher is not None and not reason:
                    reason = self._advance_grammar(seq, tok)
                if reason:
                    break
                if per_token:
                    stop_str = check_stop_strings(seq, self.detok.update(seq))
                    if stop_str is not None:
                        break
            if stop_str is None and seq.params.detokenize:
                stop_str = check_stop_strings(seq, self.detok.update(seq))
            if stop_str is not None:
                seq.stop_reason = stop_str
                reason = "stop"
            if reason:
                self.scheduler.finish(seq, reason)
                m.finished_time = now
                finished.append(seq)
            else:
                if not self.enable_kv_cache:
                    seq.num_computed_tokens = 0      # the baseline forgets its cache every step
                else:
                    self.block_manager.commit_computed(seq)
            if seq.is_finished or not self.final_outputs_only:
                outputs.append(self.make_output(seq, added))
        return outputs, first, finished

    def _check_stop_token(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.stop_reason = tok
                return "stop"
            if not p.ignore_eos and tok in self.eos_token_ids:
                return "stop"                   # stop_reason None: EOS (as vLLM)
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _advance_grammar(self, seq: Sequence, tok: int) -> str | None:
        """Feed an accepted token to the request's matcher; "stop" once the grammar is complete (nothing but
        EOS could follow) or, defensively, if the token was not allowed. A token a grammar block already fed
        it gives the outcome recorded then."""
        reason, stop_reason = seq.grammar_ahead.popleft() if seq.grammar_ahead else consume_grammar(seq, tok)
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        return reason

    def _logprob_entry(self, row: torch.Tensor, tok: int, n: int) -> list[Logprob]:
        entry = [Logprob(tok, float(row[tok]), self.detok.decode_one(tok))]
        if n:
            vals, idx = row.topk(n)
            entry += [Logprob(int(t), float(v), self.detok.decode_one(int(t))) for v, t in zip(vals, idx)]
        return entry

    def take_prompt_logprobs(self, seqs: list[Sequence], spans: list, logits: torch.Tensor) -> torch.Tensor:
        """Record the prompt logprobs of a prefill chunk; -> the other logits rows (the sampled ones), in order.
        spans: (seq index, first row, first position p, rows): row r + k scores prompt token p + k + 1."""
        keep = torch.ones(logits.shape[0], dtype=torch.bool)
        for i, row0, pos0, cnt in spans:
            seq = seqs[i]
            n = seq.params.prompt_logprobs
            lp = logits[row0:row0 + cnt].log_softmax(-1)                              # [cnt, V]
            targets = torch.tensor(seq.token_ids[pos0 + 1:pos0 + 1 + cnt], device=lp.device)
            chosen = lp.gather(1, targets[:, None])                                 # [cnt, 1]
            ranks = (lp > chosen).sum(-1) + 1                                       # [cnt]
            top = lp.topk(n) if n else None
            chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
            top_v, top_i = (top.values.tolist(), top.indices.tolist()) if n else ([[]] * cnt, [[]] * cnt)
            for k in range(cnt):
                t = seq.token_ids[pos0 + 1 + k]
                seq.prompt_logprobs[pos0 + 1 + k] = [Logprob(t, chosen[k], self.detok.decode_one(t), ranks[k])] + [
                    Logprob(tt, v, self.detok.decode_one(tt), j + 1) for j, (v, tt) in enumerate(zip(top_v[k], top_i[k]))]
            keep[row0:row0 + cnt] = False
        return logits[keep.to(logits.device)]

    def make_output(self, seq: Sequence, added: list[int]) -> RequestOutput:
        """seq's output after this step; `added` (its new token ids) becomes the output's own. With delta_outputs
        its text and token ids are the step's alone: a copy of every token so far, per request and step, would cost
        more than the rest of its post-processing, for an output that is encoded and dropped at once."""
        text, delta = seq.text, ""
        if text:                                # (no text without detokenization: nothing to hold back)
            upto = streamable_len(seq)
            delta = text[seq.sent_text_len:upto]
            seq.sent_text_len = max(seq.sent_text_len, upto)
            text = delta if self.delta_outputs else text[:upto]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text,
                             added if self.delta_outputs else seq.output_token_ids, delta,
                             added, seq.is_finished, seq.finish_reason, seq.metrics, seq.logprobs,
                             seq.prompt_logprobs, seq.stop_reason, seq.num_cached_tokens)


def consume_grammar(seq: Sequence, tok: int) -> tuple[str | None, str | None]:
    """Feed `tok` to seq's matcher -> (finish reason or None, stop_reason of a grammar error or None)."""
    m = seq.matcher
    if not m.consume_token(tok):
        return "stop", f"grammar error: {m.get_error()}"
    return ("stop" if m.is_stopped() else None), None
