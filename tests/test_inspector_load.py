"""inspector.load: arrival processes (seeded, rate and burstiness statistically right), workloads, presets,
input validation, and the runner against a fake engine loop (no model)."""
import math
import threading
import time

import numpy as np
import pytest

from engine.outputs import RequestMetrics
from inspector import load as L


# ----------------------------------------------------------------------------- arrivals
def test_arrivals_are_seeded():
    a = L.arrival_times(100, 5.0, 1.0, seed=7)
    assert np.array_equal(a, L.arrival_times(100, 5.0, 1.0, seed=7))
    assert not np.array_equal(a, L.arrival_times(100, 5.0, 1.0, seed=8))
    assert a[0] == 0 and np.all(np.diff(a) >= 0)


@pytest.mark.parametrize("rate,k", [(2.0, 1.0), (10.0, 0.25), (10.0, 4.0)])
def test_rate_and_burstiness_statistics(rate, k):
    n = 20000
    gaps = np.diff(L.arrival_times(n, rate, k, seed=0))
    # mean gap = 1/rate for every burstiness; coefficient of variation = 1/sqrt(k) (gamma)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(k), rel=0.05)


def test_poisson_counts_per_window():
    # k = 1: arrivals in 1 s windows are Poisson(rate): variance == mean
    t = L.arrival_times(50000, 20.0, 1.0, seed=1)
    counts = np.bincount(t.astype(int))[:-1]
    assert counts.mean() == pytest.approx(20.0, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


def test_burst_and_invalid_rates():
    assert np.all(L.arrival_times(10, math.inf) == 0)
    with pytest.raises(ValueError, match="rate"):
        L.arrival_times(3, 0)
    with pytest.raises(ValueError, match="burstiness"):
        L.arrival_times(3, 1.0, -1)


def test_length_distributions_stay_in_range():
    rng = np.random.default_rng(0)
    for kind in L.LENGTH_KINDS:
        d = L.LengthDist(kind, 10, 100)
        x = d.sample(5000, rng)
        assert x.min() >= 10 and x.max() <= (10 if kind == "fixed" else 100)
    assert abs(L.LengthDist("uniform", 10, 100).sample(20000, rng).mean() - 55) < 1.5


# ----------------------------------------------------------------------------- specs and presets
def test_validation_messages_name_the_knob():
    bad = [dict(num_requests=0), dict(num_requests=10**6), dict(rate=0), dict(rate=-2), dict(burstiness=0),
           dict(max_concurrency=-1), dict(prompt_len=L.LengthDist("uniform", 0, 5)),
           dict(output_len=L.LengthDist("uniform", 50, 10)), dict(seed=-1)]
    words = ["number of requests", "too many", "rate", "rate", "burstiness", "max concurrency", "prompt length",
             "output length", "seed"]
    for kw, word in zip(bad, words):
        with pytest.raises(ValueError, match=word):
            L.LoadSpec(**kw).validate()
    with pytest.raises(ValueError, match="max_model_len"):
        L.LoadSpec(prompt_len=L.LengthDist("fixed", 500, 500), output_len=L.LengthDist("fixed", 600, 600)).validate(1024)


def test_presets_fit_the_engine():
    info = L.EngineInfo(num_blocks=64, block_size=16, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=8)
    for name in L.PRESETS:
        spec = L.preset(name, info)
        spec.validate(info.max_model_len)
        assert spec.description
    mp = L.preset("Memory pressure (preemption)", info)
    # concurrent demand exceeds the pool, so the scheduler must preempt
    conc = min(mp.num_requests, info.max_num_seqs)
    assert conc * (mp.prompt_len.high + mp.output_len.high) > info.num_blocks * info.block_size
    lp = L.preset("Long prompts (chunked prefill)", info)
    assert lp.prompt_len.high > info.max_num_batched_tokens
    assert L.preset("Shared system prompt (prefix caching)", info).shared_prefix_len >= 4 * info.block_size
    with pytest.raises(ValueError, match="unknown"):
        L.preset("nope")


def test_workload_is_deterministic_and_shares_prefix():
    spec = L.LoadSpec(num_requests=8, shared_prefix_len=32, seed=3)
    p1, items1 = L.build_workload(spec, vocab_size=5000, special_ids=[1000, 1001])
    p2, items2 = L.build_workload(spec, vocab_size=5000, special_ids=[1000, 1001])
    assert p1 == p2 and [i.new_tokens for i in items1] == [i.new_tokens for i in items2]
    assert len(p1) == 32
    toks = [t for it in items1 for t in it.new_tokens] + p1
    assert min(toks) >= 500 and max(toks) < 5000 and not ({1000, 1001} & set(toks))
    for it in items1:
        assert spec.prompt_len.low <= len(it.new_tokens) <= spec.prompt_len.high


# ----------------------------------------------------------------------------- runner on a fake loop
class FakeStream:
    def __init__(self, loop, rid, prompt, params):
        self.request_id, self.prompt, self.params, self.loop = rid, prompt, params, loop
        self.done = threading.Event()
        self.cancelled = False
        self.out = None

    def cancel(self):
        self.cancelled = True
        self.loop.finish(self, "abort")

    def result(self, timeout=None):
        if not self.done.wait(timeout):
            raise TimeoutError
        return self.out


class FakeOut:
    def __init__(self, rid, prompt, n, reason, metrics):
        self.request_id, self.prompt_token_ids, self.token_ids = rid, list(prompt), list(range(7, 7 + n))
        self.finish_reason, self.metrics, self.finished = reason, metrics, True


class FakeLoop:
    """Finishes each request after `latency` s with max_tokens tokens; records concurrency. With `batch`, requests
    finish only in groups of `batch` (the group's timer starts when its last request is in), whatever the speed
    of the machine."""

    def __init__(self, latency=0.02, fail_every=0, batch=0):
        self.latency, self.fail_every, self.batch = latency, fail_every, batch
        self.pending = []
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.submitted = []
        self.submit_times = {}

    def submit(self, prompt, params, request_id=None):
        with self.lock:
            self.submitted.append((request_id, list(prompt)))
            self.submit_times[request_id] = time.perf_counter()
            if self.fail_every and len(self.submitted) % self.fail_every == 0:
                raise ValueError("prompt: too long")
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        s = FakeStream(self, request_id, prompt, params)
        s.arrival = time.perf_counter()
        if not self.batch:
            threading.Timer(self.latency, self.finish, (s, "length")).start()
            return s
        with self.lock:
            self.pending.append(s)
            group = self.pending if len(self.pending) == self.batch else None
            if group:
                self.pending = []
        if group:
            threading.Timer(self.latency, lambda: [self.finish(x, "length") for x in group]).start()
        return s

    def finish(self, s, reason):
        with self.lock:
            if s.done.is_set():
                return
            self.in_flight -= 1
        now = time.perf_counter()
        n = s.params.max_tokens if reason == "length" else 1
        times = list(np.linspace(s.arrival + 0.001, now, n))
        m = RequestMetrics(arrival_time=s.arrival, first_scheduled_time=s.arrival, first_token_time=times[0],
                           last_token_time=times[-1], finished_time=now, token_times=times)
        s.out = FakeOut(s.request_id, s.prompt, n, reason, m)
        s.done.set()


def run(loop, spec, **kw):
    r = L.LoadRunner(loop, spec, vocab_size=3000, special_ids=[], max_model_len=4096, **kw).start()
    assert r.wait(20)
    return r


def test_runner_completes_and_summarizes():
    loop = FakeLoop()
    spec = L.LoadSpec(num_requests=20, rate=200.0, prompt_len=L.LengthDist("fixed", 5, 5),
                      output_len=L.LengthDist("uniform", 2, 6), seed=1)
    r = run(loop, spec)
    p = r.progress()
    assert p["done"] and p["finished"] == 20 and p["failed"] == 0 and p["fraction"] == 1.0
    s = r.summary()
    assert s["completed"] == 20 and s["output_tokens"] == sum(i.max_tokens for i in r.items)
    assert s["TTFT"]["n"] == 20
    assert [len(pr) for _, pr in loop.submitted] == [5] * 20
    assert len({rid for rid, _ in loop.submitted}) == 20


def test_runner_respects_max_concurrency():
    # requests finish three at a time: three must be in flight together, and the limit allows no fourth
    loop = FakeLoop(latency=0.01, batch=3)
    spec = L.LoadSpec(num_requests=24, rate=math.inf, max_concurrency=3, prompt_len=L.LengthDist("fixed", 3, 3),
                      output_len=L.LengthDist("fixed", 2, 2))
    r = run(loop, spec)
    assert loop.max_in_flight == 3 and r.progress()["finished"] == 24


def test_runner_arrival_pacing_follows_the_rate():
    loop = FakeLoop(latency=0.001)
    spec = L.LoadSpec(num_requests=11, rate=50.0, burstiness=100.0, prompt_len=L.LengthDist("fixed", 2, 2),
                      output_len=L.LengthDist("fixed", 1, 1))
    r = run(loop, spec)
    # near-regular arrivals (gamma, k = 100): 10 gaps of about 20 ms
    offsets = sorted(it.arrival for it in r.items)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and len(gaps) == 10
    assert np.mean(gaps) == pytest.approx(0.02, rel=0.15) and gaps.std() / gaps.mean() < 0.3
    # each request is submitted at its offset, never before (how much later depends on the machine)
    assert len(loop.submit_times) == 11
    for it in r.items:
        assert loop.submit_times[f"L{r.run_id}-{it.index:03d}"] >= r._t_start + it.arrival


def test_runner_counts_rejected_requests_and_keeps_going():
    loop = FakeLoop(fail_every=4)
    spec = L.LoadSpec(num_requests=12, rate=math.inf, prompt_len=L.LengthDist("fixed", 2, 2),
                      output_len=L.LengthDist("fixed", 2, 2))
    r = run(loop, spec)
    p = r.progress()
    assert p["failed"] == 3 and p["finished"] == 9
    assert any("too long" in e for e in p["errors"])


def test_runner_stop_cancels_in_flight():
    loop = FakeLoop(latency=5.0)
    spec = L.LoadSpec(num_requests=6, rate=math.inf, prompt_len=L.LengthDist("fixed", 2, 2),
                      output_len=L.LengthDist("fixed", 4, 4))
    r = L.LoadRunner(loop, spec, vocab_size=3000, special_ids=[], max_model_len=4096).start()
    deadline = time.monotonic() + 60                  # a bound on a hang only: the loop ends at 6 submitted
    while r.progress()["submitted"] < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.progress()["submitted"] == 6
    r.stop()
    assert r.wait(60)
    p = r.progress()
    assert p["done"] and p["stopped"] and p["failed"] == 6


def test_multi_turn_resends_the_conversation():
    loop = FakeLoop()
    spec = L.LoadSpec(num_requests=6, rate=math.inf, num_turns=3, prompt_len=L.LengthDist("fixed", 4, 4),
                      output_len=L.LengthDist("fixed", 2, 2), shared_prefix_len=3)
    r = run(loop, spec)
    assert r.progress()["finished"] == 6
    by_user = {}
    for rid, prompt in loop.submitted:
        by_user.setdefault(rid.split("t")[0], []).append(prompt)
    assert len(by_user) == 2
    for prompts in by_user.values():
        assert [len(p) for p in prompts] == [3 + 4, 3 + 4 + 2 + 4, 3 + 4 + 2 + 4 + 2 + 4]
        assert prompts[1][: len(prompts[0])] == prompts[0]     # each turn extends the previous prompt
