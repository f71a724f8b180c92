"""The Lessons run on CPU with the tiny preset (small sweeps) and draw charts with data."""
import pytest

from inspector import figures as F
from inspector.lessons import LESSONS, Setup, run_lesson

SMALL = {"paging": dict(batches=[1, 4, 12], prompt_len=20, output_len=4, max_model_len=128),
         "kv_cache": dict(lengths=[4, 12]),
         "batching": dict(num_requests=6, max_num_seqs=2, output_range=(2, 10), prompt_range=(4, 12)),
         "batch_sweep": dict(batches=[1, 4], output_len=6),
         "chunked_prefill": dict(num_decoders=2, long_prompt=200, num_long=1, chunk=32, output_len=16),
         "kv_tiers": dict(num_requests=6, prompt_len=14, output_len=20, offload_gib=0.01)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("paging", "kv_tiers") else n for n in LESSONS])
def test_lesson_runs_and_draws(name):
    res = run_lesson(name, Setup(model="dummy:tiny", device="cpu"), **SMALL[name])
    assert res["lesson"] == name and res["what"] and res["summary"]
    spec = F.lesson_spec(res)
    F.as_figure(spec)                                   # plotly accepts every property
    assert spec["data"] and all(len(d["y"]) > 0 for d in spec["data"])
    assert res["what"] in spec["layout"]["title"]["text"]
    if name == "paging":
        s = res["summary"]
        # pool = 6 max-length reservations of 128 / 16 = 8 blocks; paged requests need 2 blocks (24 tokens) each
        assert (s["max_batch_contiguous"], s["max_batch_paged"]) == (6, 12)
        assert s["memory_ratio"] == 128 / 32            # reserved slots: max_model_len vs 2 blocks of 16
    if name == "kv_tiers":
        s, ser = res["summary"], res["series"]
        assert s["capacity_ratio"] >= 3.9                  # fp32 on CPU: 4 fp8 codes in the bytes of one value
        swaps = {a: r["swaps"] for a, r in ser.items()}
        assert all((v > 0) == a.endswith("swap") for a, v in swaps.items() if ser[a]["preemptions"]), swaps
        assert ser[list(ser)[0]]["preemptions"] > 0         # the model-dtype pool is oversubscribed
    if name == "chunked_prefill":
        assert all(len(d["itl_ms"]) == 2 * 15 for d in res["series"].values())   # every decoder's gaps
