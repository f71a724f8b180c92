"""inspector.recorder: spans from events, bounded buffers, thread safety."""
import threading

import pytest

from engine.events import EventBus, RequestEvent, ScheduledRequest, StepEvent
from inspector.recorder import Recorder
from inspector.tracks import step_output_tokens


def step(i, t, sched, preempted=(), finished=(), spec=None, **kw):
    return StepEvent(step=i, start=t, end=t + 0.01, scheduled=sched,
                     num_prefill_tokens=sum(s.num_tokens for s in sched if s.phase == "prefill"),
                     num_decode_tokens=sum(s.num_tokens for s in sched if s.phase == "decode"),
                     num_running=len(sched), num_waiting=0, blocks_allocated=[], blocks_freed=[], blocks_evicted=[],
                     blocks_shared=0, preempted=list(preempted), finished=list(finished), kv_usage=0.5,
                     num_blocks=8, spec=spec, **kw)


def test_spans_chunked_prefill_decode_preempt_recompute():
    rec = Recorder()
    bus = EventBus()
    rec.attach(bus)
    P = ScheduledRequest
    bus.emit(RequestEvent("arrived", "a", 0.0, 0, prompt_len=20))
    bus.emit(step(1, 0.05, [P("a", 10, "prefill", 0, 20)]))             # chunk 1
    bus.emit(step(2, 0.06, [P("a", 10, "prefill", 10, 20)]))            # chunk 2 -> first token
    bus.emit(step(3, 0.07, [P("a", 1, "decode", 20, 21)]))
    bus.emit(step(4, 0.08, [P("a", 1, "decode", 21, 22)], preempted=["a"]))
    bus.emit(step(6, 0.20, [P("a", 22, "prefill", 0, 23)]))             # recompute after preemption
    bus.emit(step(7, 0.21, [P("a", 1, "decode", 23, 24)], finished=["a"]))
    bus.emit(RequestEvent("finished", "a", 0.22, 7, prompt_len=20, output_len=5, finish_reason="length"))
    snap = rec.snapshot()
    (a,) = snap.requests
    phases = [(s.phase, s.step_start, s.step_end) for s in a.spans]
    assert phases == [("waiting", 0.0, 1.0), ("prefill", 1.0, 3.0), ("decode", 3.0, 5.0), ("preempted", 5.0, 6.0),
                      ("prefill", 6.0, 7.0), ("decode", 7.0, 8.0)]
    assert a.spans[1].num_tokens == 20 and a.spans[4].note == "recompute"
    assert a.spans[0].start == 0.0 and a.spans[0].end == pytest.approx(0.05)
    assert a.spans[3].start == pytest.approx(0.09) and a.spans[3].end == pytest.approx(0.20)
    assert a.status == "finished" and a.num_preemptions == 1 and a.finish_reason == "length"
    assert a.first_token == pytest.approx(0.07)
    t = snap.totals
    assert t["steps"] == 6 and t["preemptions"] == 1 and t["finished"] == 1 and t["arrived"] == 1
    assert t["prompt_tokens"] == 20 + 22


def test_snapshot_is_incremental_and_detached(engine_run):
    rec = Recorder()
    evs = engine_run.events
    for e in evs[: len(evs) // 2]:
        rec(e)
    s1 = rec.snapshot()
    n1 = sum(len(r.spans) for r in s1.requests)
    for e in evs[len(evs) // 2:]:
        rec(e)
    s2 = rec.snapshot()
    # the first snapshot was not mutated by the second's processing
    assert sum(len(r.spans) for r in s1.requests) == n1 < sum(len(r.spans) for r in s2.requests)
    assert s1.totals["finished"] < s2.totals["finished"] == len(engine_run.outputs)
    full = Recorder()
    engine_run.feed(full)
    s3 = full.snapshot()
    key = lambda s: [(r.request_id, [(x.phase, x.start, x.end) for x in r.spans]) for r in s.requests]  # noqa: E731
    assert key(s2) == key(s3)
    assert s2.version > s1.version


def test_spans_follow_the_engine_events(engine_run):
    """Every request's track agrees with what the engine emitted: prompt length, finish, preemptions, and its
    prefill / decode spans cover exactly the steps that scheduled it."""
    snap = engine_run.snapshot()
    assert len(snap.requests) == len(engine_run.outputs) == 24
    sched_steps: dict = {}
    for st in engine_run.steps:
        for sr in st.scheduled:
            sched_steps.setdefault(sr.request_id, set()).add(st.step)
    for tr in snap.requests:
        out = engine_run.outputs[tr.request_id]
        assert tr.status == "finished" and tr.finish_reason == out.finish_reason == "length"
        assert tr.prompt_len == len(out.prompt_token_ids)
        assert tr.num_preemptions == out.metrics.num_preemptions
        run = {s for sp in tr.spans if sp.phase in ("prefill", "decode")
               for s in range(int(sp.step_start), int(sp.step_end))}
        assert run == sched_steps[tr.request_id]
        assert [sp.phase for sp in tr.spans].count("preempted") == tr.num_preemptions
    pre = [rid for st in engine_run.steps for rid in st.preempted]
    assert pre and snap.totals["preemptions"] == len(pre)
    assert snap.totals["steps"] == len(engine_run.steps)


def test_ring_buffers_are_bounded(engine_run):
    rec = Recorder(max_steps=16, max_requests=8, max_events=64)
    engine_run.feed(rec)
    snap = rec.snapshot()
    assert len(engine_run.steps) > 16 and len(engine_run.outputs) > 8 and len(engine_run.events) > 64
    assert len(snap.steps) == 16 and len(snap.requests) <= 8
    assert snap.steps == engine_run.steps[-16:]
    assert snap.dropped_events == len(engine_run.events) - 64


def test_listener_is_thread_safe_with_concurrent_snapshots(engine_run):
    rec = Recorder()
    errors = []

    def reader():
        try:
            for _ in range(50):
                rec.snapshot()
        except Exception as e:  # pragma: no cover
            errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    for e in engine_run.events:
        rec(e)
    th.join()
    assert not errors
    assert rec.snapshot().totals["finished"] == len(engine_run.outputs)


def test_requests_seen_before_subscription_and_spec_totals():
    rec = Recorder()
    P = ScheduledRequest
    rec(step(5, 1.0, [P("x", 1, "decode", 9, 10, 3)], spec=dict(num_drafts=1, num_draft_tokens=3,
                                                               num_accepted_tokens=2, accepted_per_pos=[1, 1, 0])))
    snap = rec.snapshot()
    assert snap.requests[0].request_id == "x" and snap.requests[0].spans[0].phase == "decode"
    assert snap.spec["num_accepted_tokens"] == 2 and snap.spec["accepted_per_pos"] == [1, 1, 0]
    assert step_output_tokens(snap.steps[0]) == 3


def test_detach_and_clear(engine_run):
    bus = EventBus()
    rec = Recorder().attach(bus)
    assert bus.active
    rec.detach()
    assert not bus.active
    engine_run.feed(rec)
    assert rec.snapshot().steps
    rec.clear()
    snap = rec.snapshot()
    assert not snap.steps and not snap.requests and not snap.records
