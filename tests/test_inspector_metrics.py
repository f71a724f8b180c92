"""inspector.metrics against hand-computed cases."""
import math

import numpy as np
import pytest

from engine.outputs import RequestMetrics
from inspector import metrics as M
from inspector.recorder import RequestRecord


def rec(rid, arrival, token_times, prompt_len=10, finish="length", preempt=0, cached=0, sched=None):
    m = RequestMetrics(arrival_time=arrival, first_scheduled_time=sched if sched is not None else arrival,
                       first_token_time=token_times[0] if token_times else None,
                       last_token_time=token_times[-1] if token_times else None,
                       finished_time=token_times[-1] if token_times else arrival + 1,
                       token_times=list(token_times), num_preemptions=preempt, num_cached_tokens=cached)
    return RequestRecord(rid, prompt_len, len(token_times), finish, m)


# Request a: arrives 0, tokens at 1, 2, 4   -> TTFT 1, E2EL 4, TPOT (4-1)/2 = 1.5, ITL 1, 2
# Request b: arrives 1, tokens at 1.5, 2.5  -> TTFT .5, E2EL 1.5, TPOT 1, ITL 1
# Request c: arrives 2, one token at 5      -> TTFT 3, E2EL 3, TPOT none (1 token), no ITL
A = rec("a", 0.0, [1.0, 2.0, 4.0], prompt_len=10, preempt=1)
B = rec("b", 1.0, [1.5, 2.5], prompt_len=20, cached=16)
C = rec("c", 2.0, [5.0], prompt_len=30)


def test_request_frame_hand_computed():
    df = M.request_frame([A, B, C]).set_index("request_id")
    assert df.loc["a", "ttft"] == pytest.approx(1.0)
    assert df.loc["a", "e2el"] == pytest.approx(4.0)
    assert df.loc["a", "tpot"] == pytest.approx(1.5)
    assert df.loc["b", "tpot"] == pytest.approx(1.0)
    assert math.isnan(df.loc["c", "tpot"])       # first token excluded: undefined for one token
    assert df.loc["c", "ttft"] == pytest.approx(3.0)


def test_itl_pools_gaps_between_outputs():
    assert sorted(M.itl_values([A, B, C]).tolist()) == pytest.approx([1.0, 1.0, 2.0])


def test_summary_percentiles_and_throughput():
    s = M.summarize([A, B, C])
    # duration = first arrival (0) -> last token (5)
    assert s["duration_s"] == pytest.approx(5.0)
    assert s["completed"] == 3 and s["failed"] == 0
    assert s["output_tokens"] == 6 and s["prompt_tokens"] == 60
    assert s["output_throughput"] == pytest.approx(6 / 5)
    assert s["total_throughput"] == pytest.approx(66 / 5)
    assert s["request_throughput"] == pytest.approx(3 / 5)
    # TTFT in ms: [1000, 500, 3000]; mean 1500, p50 1000, p90 = 1000 + 0.8*2000 = 2600 (linear)
    assert s["TTFT"]["mean"] == pytest.approx(1500)
    assert s["TTFT"]["p50"] == pytest.approx(1000)
    assert s["TTFT"]["p90"] == pytest.approx(2600)
    assert s["TTFT"]["p99"] == pytest.approx(1000 + 0.98 * 2000)
    # TPOT over requests with >= 2 tokens: [1500, 1000]
    assert s["TPOT"]["n"] == 2 and s["TPOT"]["mean"] == pytest.approx(1250)
    # ITL [1000, 2000, 1000] ms
    assert s["ITL"]["mean"] == pytest.approx(4000 / 3) and s["ITL"]["p50"] == pytest.approx(1000)
    assert s["E2EL"]["mean"] == pytest.approx((4000 + 1500 + 3000) / 3)
    assert s["preemptions"] == 1
    assert s["prefix_cache_hit_rate"] == pytest.approx(16 / 60)
    assert s["goodput"] is None                    # no SLO set


def test_goodput_counts_requests_meeting_every_slo():
    # TTFT <= 1200 ms: a (1000) and b (500) pass, c (3000) fails
    s = M.summarize([A, B, C], slo=M.SLO(ttft_ms=1200))
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(2 / 5)
    # add TPOT <= 1200 ms: a (1500) fails; c has 1 token so TPOT is vacuous but TTFT fails
    s = M.summarize([A, B, C], slo=M.SLO(ttft_ms=1200, tpot_ms=1200))
    assert s["good_requests"] == 1
    # E2EL <= 3000: b (1500) and c (3000) pass
    s = M.summarize([A, B, C], slo={"e2el_ms": 3000})
    assert s["good_requests"] == 2


def test_aborted_requests_are_not_completed():
    D = rec("d", 0.5, [0.7, 0.8], finish="abort")
    s = M.summarize([A, B, C, D])
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["output_tokens"] == 6


def test_explicit_duration_and_empty_input():
    s = M.summarize([A, B], duration=10.0)
    assert s["output_throughput"] == pytest.approx(0.5)
    e = M.summarize([])
    assert e["completed"] == 0 and math.isnan(e["TTFT"]["mean"]) and math.isnan(e["output_throughput"])
    assert len(M.summary_table(e)) >= 8


def test_slo_validation():
    with pytest.raises(ValueError, match="ttft_ms"):
        M.SLO(ttft_ms=-1)


def test_summary_table_labels_every_metric_with_its_definition():
    t = M.summary_table(M.summarize([A, B, C], slo=M.SLO(ttft_ms=1200)))
    names = " ".join(t["Metric"])
    for key in ("TTFT", "TPOT", "ITL", "E2EL", "Goodput", "Output throughput", "Preemptions"):
        assert key in names
    assert all(t["Definition"].str.len() > 0)
    assert "first token excluded" in t.loc[t.Metric.str.startswith("TPOT"), "Definition"].iloc[0]


def test_stats_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    v = rng.exponential(size=1001)
    s = M.stats(v, scale=1.0)
    for p in (50, 90, 99):
        assert s[f"p{p}"] == pytest.approx(np.percentile(v, p))


def test_request_stats_for_playground():
    class Out:
        token_ids = [1, 2, 3]
        prompt_token_ids = [5] * 7
        finish_reason = "length"
        metrics = A.metrics
    s = M.request_stats(Out())
    assert s["ttft_ms"] == pytest.approx(1000) and s["tpot_ms"] == pytest.approx(1500)
    assert s["decode_tok_s"] == pytest.approx(2 / 3) and s["preemptions"] == 1
