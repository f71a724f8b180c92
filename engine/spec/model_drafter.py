"""Model-based drafting: a separate draft model ("draft") or the target's first L layers ("self").

Both run k small autoregressive forwards over the paged KV before the step is scheduled, batched over all
decoding requests: the first feeds the request's last token (plus, for the draft model, any tokens its
cache has not seen yet), each next one feeds the previous draft.

KV placement. Draft slots use the request's own block table: propose() allocates the blocks the draft
positions need (skipping or shortening drafts when the pool is short, keeping a reserve for the verify).
- "self": the draft's layers ARE the target's first L layers, so the target's cache already holds their
  K/V for every computed position, and the draft writes its layers' K/V for the draft positions into that
  same cache. The verify forward then recomputes every draft position through all layers, overwriting those
  slots with the target's own values; rejected positions lie beyond num_computed_tokens and are
  overwritten later. Nothing extra to keep in sync.
- "draft": a second KV pool with the target's num_blocks and block size, addressed through the target's
  block tables (same block ids, separate tensors). Each request remembers how far the draft cache is valid
  (`_DraftState`), catches up on tokens it has not seen (the prompt, a bonus token, a corrected token) in
  its first draft forward, and restarts from 0 after a preemption. Prefix-cached blocks get their draft K/V
  rewritten by the new request (same tokens, same values), so sharing stays correct.

Sampled requests draw drafts from the draft's own filtered distribution q (penalties, the min_tokens ban,
temperature, top-k/p, min-p) and keep q for the rejection rule; greedy requests take the draft's argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.config import ModelArchConfig
from engine.sample.sampler import _apply_penalties, _seeded_generator, filtered_probs
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence
from engine.worker.timing import NullTimer
from engine.spec.base import Drafter

_DRAFT_SEED_SALT = 0x5EED


@dataclass
class _DraftState:
    num_preemptions: int
    valid: int                       # positions [0, valid) of the draft cache hold this request's K/V
    fed: list[int] = field(default_factory=list)   # draft tokens fed at positions valid, valid+1, ...


def parse_draft_model(spec: str, default_seed: int) -> tuple[str, int]:
    """'dummy:tiny@7' -> ('dummy:tiny', 7): a random-weight draft with its own seed."""
    if "@" in spec:
        name, s = spec.rsplit("@", 1)
        if s.isdigit():
            return name, int(s)
    return spec, default_seed


def load_draft_model(engine):
    from engine.models.loader import build_model, resolve
    cfg = engine.config
    name, seed = parse_draft_model(cfg.speculative_config.draft_model, cfg.model_config.seed)
    hf_cfg, weights, _ = resolve(name)
    dcfg = ModelArchConfig.from_hf(hf_cfg)
    model = build_model(hf_cfg, weights, engine.ops, engine.device, engine.dtype,
                        max_pos=engine.max_model_len + cfg.speculative_config.num_speculative_tokens + 1, seed=seed)
    model.gemv_max_tokens, model.gemv_pdl = engine.model.gemv_max_tokens, engine.model.gemv_pdl
    model.set_kernel_options(engine.config)
    kv = torch.zeros(2, dcfg.num_layers, engine.num_blocks, cfg.cache_config.block_size, dcfg.num_kv_heads,
                     dcfg.head_dim, dtype=engine.runner.kv_dtype, device=engine.device)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_cache = kv[0, i]
        layer.self_attn.v_cache = kv[1, i]
    return model, dcfg, kv


def _work(model, num_layers: int | None) -> int:
    layers = model.model.layers[:num_layers]
    return sum(p.numel() for p in layers.parameters()) + model.lm_head.in_features * model.lm_head.out_features


class ModelDrafter(Drafter):
    def __init__(self, engine, self_speculative: bool):
        super().__init__(engine)
        self.shared = self_speculative
        mcfg = engine.arch_config
        self.vocab_size = mcfg.vocab_size
        if self_speculative:
            self.method = "self"
            self.model = engine.model
            self.num_layers = min(engine.config.speculative_config.draft_layers, mcfg.num_layers)
            self.kv = None
        else:
            self.method = "draft"
            self.model, self.draft_config, self.kv = load_draft_model(engine)
            self.num_layers = None
        self.states: dict[str, _DraftState] = {}
        # adaptive drafting: one draft token's work relative to a target decode step, by parameters read
        # (layers + LM head; the embedding lookup is free)
        self.draft_cost = _work(self.model, self.num_layers) / _work(engine.model, None)

    # ---- one draft forward ---------------------------------------------------------------------
    def _forward(self, seqs: list[Sequence], starts: list[int], num_new: list[int]) -> torch.Tensor:
        """Compute positions [start, start + n) of each seq (token_ids + spec_token_ids) -> logits [B, V]."""
        B = len(seqs)
        sched = SchedulerOutput(seqs=seqs, num_new_tokens=num_new, num_spec_tokens=[0] * B,
                                computed_before=starts)
        ids, md = self.engine.runner.prepare(sched, [True] * B, None)
        graphs = self.engine.runner.graphs
        if self.shared and graphs is not None and graphs.can_run(md, self.num_layers):
            logits = graphs.run(ids, md, self.num_layers)          # the first layers' own CUDA graph
        elif self.shared:
            logits = self.model.compute_logits(self.model(ids, md, num_layers=self.num_layers)[md.logits_indices])
        else:
            logits = self.model.compute_logits(self.model(ids, md)[md.logits_indices])
        V = self.vocab_size
        if logits.shape[1] > V:
            logits = logits[:, :V]
        elif logits.shape[1] < V:
            pad = logits.new_full((B, V - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        return logits

    def _pick(self, seqs: list[Sequence], logits: torch.Tensor, qs: list[list]) -> list[int]:
        """Next draft token per seq; sampled requests draw from q and record it."""
        eng = self.engine
        rows = [eng.sampler.row(s, s.spec_token_ids) for s in seqs]
        if any(r.banned or r.params.needs_penalties for r in rows):   # draft under the target's rules
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.banned:
                    logits[i, r.banned] = float("-inf")
            _apply_penalties(logits, rows)
        toks = logits.argmax(-1)
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            probs = filtered_probs(logits[sampled], [rows[i] for i in sampled])
            for n, i in enumerate(sampled):
                p = seqs[i].params
                if p.seed is None:
                    gen = eng.sampler.generator
                else:
                    gen = _seeded_generator(p.seed ^ _DRAFT_SEED_SALT, rows[i].position, probs.device)
                toks[i] = torch.multinomial(probs[n], 1, generator=gen)[0]
                qs[i].append(probs[n])
        return toks.tolist()

    # ---- propose -------------------------------------------------------------------------------
    def _start(self, seq: Sequence) -> int:
        """First position the draft must compute (its cache is valid before it)."""
        if self.shared:
            return seq.num_computed_tokens
        st = self.states.get(seq.request_id)
        if st is None or st.num_preemptions != seq.metrics.num_preemptions:
            return 0
        v, m, toks = st.valid, 0, seq.token_ids
        while m < len(st.fed) and v + m < len(toks) and toks[v + m] == st.fed[m]:
            m += 1
        return min(v + m, seq.num_tokens - 1)

    @torch.inference_mode()
    def draft(self, cands: list[tuple[Sequence, int]]) -> None:
        eng = self.engine
        bm = eng.block_manager
        batch: list[tuple[Sequence, int]] = []
        reserve = len(cands)        # roughly one block per request for the verify step's growth
        for seq, k in cands:
            # draft positions n-1 .. n+k-2 need num_computed (= n-1) + k token slots
            while k > 0 and bm.blocks_needed(seq, seq.num_computed_tokens + k) > bm.num_free_blocks - reserve:
                k -= 1
            if k > 0:
                bm.allocate(seq, k)
                batch.append((seq, k))
        if not self.shared:
            live = {s.request_id for s in eng.scheduler.running}
            if len(self.states) > 2 * len(live) + 64:
                self.states = {r: s for r, s in self.states.items() if r in live}
        if not batch:
            return
        saved_timer = self.model.timer
        self.model.timer = NullTimer()
        try:
            seqs = [s for s, _ in batch]
            ks = [k for _, k in batch]
            starts = [self._start(s) for s in seqs]
            qs: list[list] = [[] for _ in seqs]
            for s in seqs:
                s.spec_token_ids = []
            logits = self._forward(seqs, starts, [s.num_tokens - st for s, st in zip(seqs, starts)])
            for s, t in zip(seqs, self._pick(seqs, logits, qs)):
                s.spec_token_ids.append(t)
            for j in range(1, max(ks)):
                act = [i for i, k in enumerate(ks) if k > j]
                a_seqs = [seqs[i] for i in act]
                # feed draft j (already at spec_token_ids[j-1]) at position n-1+j
                logits = self._forward(a_seqs, [s.num_tokens - 1 + j for s in a_seqs], [1] * len(act))
                a_qs = [qs[i] for i in act]
                for s, t in zip(a_seqs, self._pick(a_seqs, logits, a_qs)):
                    s.spec_token_ids.append(t)
        finally:
            self.model.timer = saved_timer
        for s, q in zip(seqs, qs):
            if q:
                self._q[s.request_id] = torch.stack(q)
            if not self.shared:
                # the draft cache now holds positions < n, and the drafts fed at n, n+1, ... (k-1 of them)
                self.states[s.request_id] = _DraftState(s.metrics.num_preemptions, s.num_tokens,
                                                        list(s.spec_token_ids[:-1]))
