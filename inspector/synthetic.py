"""A toy continuous-batching scheduler that emits the engine's event schema without a model.

It exists so the inspector's figures, metrics and exports can be tested (and shown in a notebook)
without loading weights: token-budget steps, decodes first, chunked prefill, recompute preemption of the
last running request, a ref-counted block pool with a prefix cache for one shared prefix, and optional
speculative-decoding counters. Times are fake perf_counter seconds from a simple cost model.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.events import RequestEvent, ScheduledRequest, StepEvent
from engine.outputs import RequestMetrics
from inspector.recorder import RequestRecord


@dataclass
class _Req:
    rid: str
    arrival: float
    prompt: int
    max_tokens: int
    generated: int = 0
    computed: int = 0
    blocks: list = field(default_factory=list)
    metrics: RequestMetrics = None
    admitted_once: bool = False

    @property
    def total(self) -> int:
        return self.prompt + self.generated


@dataclass
class SyntheticRun:
    events: list                   # StepEvent and RequestEvent in emission order
    records: list[RequestRecord]   # finished requests with their stamps
    kv: dict                       # a kv_snapshot() taken at the step of peak usage
    num_blocks: int
    block_size: int

    @property
    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]

    def feed(self, recorder) -> None:
        for e in self.events:
            recorder(e)
        for r in self.records:
            recorder.record_output(r)


def simulate(num_requests: int = 24, seed: int = 0, rate: float = 40.0, burstiness: float = 1.0,
             prompt_len: tuple[int, int] = (16, 96), output_len: tuple[int, int] = (8, 40),
             num_blocks: int = 48, block_size: int = 16, max_num_batched_tokens: int = 128,
             max_num_seqs: int = 8, shared_prefix_blocks: int = 0, spec_tokens: int = 0,
             t_start: float = 1000.0) -> SyntheticRun:
    from inspector.load.arrivals import arrival_times
    rng = np.random.default_rng(seed)
    arr = t_start + arrival_times(num_requests, rate, burstiness, seed=seed)
    reqs = deque(_Req(f"r{i:02d}", float(arr[i]), int(rng.integers(prompt_len[0], prompt_len[1] + 1))
                      + shared_prefix_blocks * block_size,
                      int(rng.integers(output_len[0], output_len[1] + 1))) for i in range(num_requests))
    for r in reqs:
        r.metrics = RequestMetrics(arrival_time=r.arrival)
    ref = [0] * num_blocks
    cached = [False] * num_blocks
    prefix_cache: dict[int, int] = {}          # prefix block index -> physical block
    free = deque(range(1, num_blocks))         # block 0 reserved, as in vLLM
    events: list = []
    records: list[RequestRecord] = []
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    now = t_start
    step = -1
    peak = (-1.0, None)
    per_step: dict = {}

    def alloc() -> int | None:
        for _ in range(len(free)):
            b = free.popleft()
            if cached[b]:
                # evict: drop its hash so it can be reused
                cached[b] = False
                for k, v in list(prefix_cache.items()):
                    if v == b:
                        del prefix_cache[k]
                per_step["evicted"].append(b)
            ref[b] = 1
            per_step["alloc"].append(b)
            return b
        return None

    def release(r: _Req) -> None:
        for b in r.blocks:
            ref[b] -= 1
            if ref[b] == 0:
                if cached[b]:
                    free.append(b)          # cached-free: reusable, evicted last (LRU tail)
                else:
                    free.appendleft(b)
                per_step["freed"].append(b)
        r.blocks = []

    def ensure(r: _Req, upto: int) -> bool:
        need = math.ceil(upto / block_size) - len(r.blocks)
        if need > len(free):
            return False
        for _ in range(need):
            r.blocks.append(alloc())
        return True

    while reqs or waiting or running:
        if not waiting and not running and reqs and reqs[0].arrival > now:
            now = reqs[0].arrival
        while reqs and reqs[0].arrival <= now:
            r = reqs.popleft()
            waiting.append(r)
            events.append(RequestEvent("arrived", r.rid, r.arrival, step, prompt_len=r.prompt))
        step += 1
        per_step = dict(alloc=[], freed=[], evicted=[], shared=0, q=0, hits=0)
        budget = max_num_batched_tokens
        sched: list[tuple[_Req, int, str, int, int]] = []
        preempted: list[str] = []
        start = now
        # running first: decodes (and continuing prefill chunks)
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.total - r.computed, budget)
            while not ensure(r, r.computed + n):
                victim = running[-1]
                running.pop()
                release(victim)
                victim.computed = 0
                victim.metrics.num_preemptions += 1
                waiting.appendleft(victim)
                preempted.append(victim.rid)
                events.append(RequestEvent("preempted", victim.rid, start, step, prompt_len=victim.prompt,
                                           output_len=victim.generated))
                if victim is r:
                    break
            if r not in running:
                continue
            phase = "prefill" if r.total - r.computed > 1 or r.generated == 0 else "decode"
            sched.append((r, n, phase, r.computed, r.total))
            budget -= n
            i += 1
        # then admit waiting requests
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting[0]
            if r.computed == 0 and shared_prefix_blocks and not r.blocks:
                hits = [prefix_cache.get(k) for k in range(shared_prefix_blocks)]
                per_step["q"] += r.prompt
                if all(h is not None for h in hits):
                    for b in hits:
                        if ref[b] == 0:
                            free.remove(b)
                        ref[b] += 1
                    r.blocks = list(hits)
                    r.computed = shared_prefix_blocks * block_size
                    per_step["shared"] += len(hits)
                    per_step["hits"] += r.computed
                    if not r.admitted_once:
                        r.metrics.num_cached_tokens = r.computed
            n = min(r.total - r.computed, budget)
            if not ensure(r, r.computed + n):
                break
            waiting.popleft()
            running.append(r)
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = start
            r.admitted_once = True
            events.append(RequestEvent("scheduled", r.rid, start, step, prompt_len=r.prompt,
                                       num_cached_tokens=r.metrics.num_cached_tokens, block_table=list(r.blocks)))
            sched.append((r, n, "prefill", r.computed, r.total))
            budget -= n
        if not sched:
            if reqs:
                now = max(now, reqs[0].arrival)
                step -= 1
                continue
            break
        num_tokens = sum(s[1] for s in sched)
        dur = 0.004 + 0.00004 * num_tokens + 0.0002 * len(sched)
        end = start + dur
        finished: list[str] = []
        spec = None
        n_drafts = n_draft_tok = n_acc = 0
        acc_pos = [0] * spec_tokens
        for r, n, phase, before, total in sched:
            r.computed += n
            if shared_prefix_blocks and r.computed >= shared_prefix_blocks * block_size:
                for k in range(shared_prefix_blocks):
                    if k < len(r.blocks) and k not in prefix_cache:
                        prefix_cache[k] = r.blocks[k]
                        cached[r.blocks[k]] = True
            if r.computed >= r.total:
                new = 1
                if spec_tokens and phase == "decode":
                    n_drafts += 1
                    n_draft_tok += spec_tokens
                    a = 0
                    while a < spec_tokens and rng.random() < 0.75 - 0.1 * a:
                        acc_pos[a] += 1
                        a += 1
                    n_acc += a
                    new += a
                new = min(new, r.max_tokens - r.generated)
                r.generated += new
                r.computed += new - 1          # accepted drafts were computed while being verified
                r.metrics.token_times.append(end)
                if r.metrics.first_token_time is None:
                    r.metrics.first_token_time = end
                    events.append(RequestEvent("first_token", r.rid, end, step, prompt_len=r.prompt, output_len=1))
                r.metrics.last_token_time = end
                if r.generated >= r.max_tokens:
                    finished.append(r.rid)
        if spec_tokens and n_drafts:
            spec = dict(num_drafts=n_drafts, num_draft_tokens=n_draft_tok, num_accepted_tokens=n_acc,
                        accepted_per_pos=acc_pos)
        for rid in finished:
            r = next(x for x in running if x.rid == rid)
            running.remove(r)
            bt = list(r.blocks)
            release(r)
            r.metrics.finished_time = end
            events.append(RequestEvent("finished", r.rid, end, step, prompt_len=r.prompt, output_len=r.generated,
                                       num_cached_tokens=r.metrics.num_cached_tokens, finish_reason="length",
                                       block_table=bt))
            records.append(RequestRecord(r.rid, r.prompt, r.generated, "length", r.metrics))
        used = sum(1 for x in ref if x > 0)
        timings = {}
        model = dur * 0.8
        for k, f in (("embedding", 0.02), ("attention", 0.38), ("mlp", 0.42), ("norms", 0.06), ("lm_head", 0.12)):
            timings[k] = model * f
        timings.update(forward=model, schedule=dur * 0.05, prepare=dur * 0.06, sampling=dur * 0.04,
                       postprocess=dur * 0.02)
        ev = StepEvent(step=step, start=start, end=end,
                       scheduled=[ScheduledRequest(r.rid, n, ph, b, t, spec_tokens if (spec and ph == "decode") else 0)
                                  for r, n, ph, b, t in sched],
                       num_prefill_tokens=sum(n for _, n, ph, _, _ in sched if ph == "prefill"),
                       num_decode_tokens=sum(n for _, n, ph, _, _ in sched if ph == "decode"),
                       num_running=len(running), num_waiting=len(waiting),
                       blocks_allocated=per_step["alloc"], blocks_freed=per_step["freed"],
                       blocks_evicted=per_step["evicted"], blocks_shared=per_step["shared"],
                       preempted=preempted, finished=finished, kv_usage=used / num_blocks, num_blocks=num_blocks,
                       prefix_cache_queries=per_step["q"], prefix_cache_hits=per_step["hits"], timings=timings,
                       spec=spec)
        events.append(ev)
        if used / num_blocks >= peak[0]:
            peak = (used / num_blocks, dict(num_blocks=num_blocks, block_size=block_size, ref_counts=list(ref),
                                            cached=list(cached),
                                            block_tables={r.rid: list(r.blocks) for r in running}))
        now = end
    kv = peak[1] or dict(num_blocks=num_blocks, block_size=block_size, ref_counts=ref, cached=cached, block_tables={})
    return SyntheticRun(events=events, records=records, kv=kv, num_blocks=num_blocks, block_size=block_size)
