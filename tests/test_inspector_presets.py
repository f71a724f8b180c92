"""Presets sized from the engine's measured capacity: measured here, in the same process and engine, then each
calibrated steady preset runs against that engine and must keep its waiting queue bounded. Outcomes come from
the engine's own step events (num_waiting after each step). Whether *Overload* queues depends on the machine
keeping its measured speed (a shared CI core may not), so benchmarks/bench_presets.py shows that, not a test."""
import math

import pytest

from engine.config import EngineConfig
from inspector import load as L
from inspector.recorder import Recorder
from webui.host import EngineHost

STEADY = ("Steady Poisson", "Long prompts (chunked prefill)", "Many short chats",
          "Shared system prompt (prefix caching)", "Multi-turn chat", "Real text (speculative decoding)")
MAX_SEQS = 4


@pytest.fixture(scope="module")
def engine():
    cfg = EngineConfig(model="dummy:tiny", device="cpu", max_num_seqs=MAX_SEQS, max_model_len=128,
                       max_num_batched_tokens=256, num_kv_blocks=256)
    host = EngineHost(cfg).start(inspect=False)
    rec = Recorder().attach(host.loop.engine.events)
    info = host.engine_info()
    yield host.loop, rec, info
    host.shutdown()


def peak_waiting(loop, rec, spec) -> int:
    """Run `spec` to completion; the most requests the engine had waiting after any of the run's steps."""
    rec.clear()
    runner = L.LoadRunner(loop, spec, recorder=rec).start()
    assert runner.wait(300), "load did not finish"
    p = runner.progress()
    assert p["finished"] == spec.num_requests and p["failed"] == 0, p
    steps = rec.snapshot().steps
    assert steps
    return max(s.num_waiting for s in steps)


def test_capacity_is_measured_and_sets_the_rates(engine):
    _, _, info = engine
    cap = info.capacity
    assert cap is not None and cap.prefill_tok_s > 0 and cap.decode_tok_s(MAX_SEQS) >= cap.decode_tok_s(1) > 0
    steady, over = L.preset("Steady Poisson", info), L.preset("Overload", info)
    sustained = cap.req_per_s((steady.prompt_len.low + steady.prompt_len.high) / 2,
                              (steady.output_len.low + steady.output_len.high) / 2)
    assert steady.rate == pytest.approx(0.55 * sustained, rel=0.06)         # 2 significant digits
    assert over.rate == pytest.approx(3.0 * sustained, rel=0.06)
    assert f"Calibrated: {steady.rate:g} req/s" in steady.description
    for name in L.PRESETS:                    # every preset fits this engine's limits
        L.preset(name, info).validate(128)
    # without a measurement the presets keep their fixed rates
    assert L.preset("Steady Poisson", L.EngineInfo()).rate == 4.0


@pytest.mark.slow
def test_steady_presets_keep_the_queue_bounded(engine):
    loop, rec, info = engine
    peaks = {}
    for name in STEADY:
        spec = L.preset(name, info)
        per_user = max(1, spec.num_turns)
        spec = L.preset(name, info, num_requests=4 * MAX_SEQS if per_user == 1 else MAX_SEQS * per_user)
        assert math.isfinite(spec.rate)
        peaks[name] = peak_waiting(loop, rec, spec)
    # a steady load never queues more than a few batches behind the running batch (bursty arrivals included)
    assert all(v <= 3 * MAX_SEQS for v in peaks.values()), peaks
