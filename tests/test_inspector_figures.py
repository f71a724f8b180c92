"""inspector.figures: every builder from events recorded on a real tiny CPU engine (conftest's engine_run and
spec_engine_run): traces present, shapes right, valid Plotly (each spec goes through plotly's validating Figure
constructor), JSON-safe, explicit heights."""
import json

import numpy as np
import pytest

from inspector import figures as F
from inspector.recorder import Recorder


@pytest.fixture(scope="module")
def snap(spec_engine_run):
    return spec_engine_run.snapshot()


@pytest.fixture(scope="module")
def plain_snap(engine_run):
    return engine_run.snapshot()


def traces(spec, type_=None, name=None):
    return [d for d in spec["data"] if (type_ is None or d["type"] == type_) and (name is None or d.get("name") == name)]


def check(spec):
    fig = F.as_figure(spec)                      # raises on any invalid property
    assert spec["layout"]["height"] > 0 and spec["layout"].get("uirevision")
    json.loads(F.to_json(spec))                 # strict JSON (no NaN)
    return fig


def test_block_map_cells_states_and_hover(snap):
    kv = snap.kv
    spec = F.block_map_spec(kv)
    check(spec)
    (hm,) = traces(spec, "heatmap")
    z = np.array([[np.nan if v is None else v for v in row] for row in hm["z"]], dtype=float)
    rows, cols = z.shape
    assert rows * cols >= kv["num_blocks"] and cols >= 8
    flat = z.reshape(-1)[: kv["num_blocks"]]
    ref = np.array(kv["ref_counts"])
    in_use = np.nonzero(ref == 1)[0]
    assert len(in_use) and (ref > 1).any()                    # the recorded pool holds owned and shared blocks
    assert (flat[in_use] >= 3).all()                          # owner colours
    assert (flat[np.nonzero(ref > 1)[0]] == 2).all()          # shared
    free = [b for b in np.nonzero(ref == 0)[0] if b > 0]      # block 0 is the reserved null block
    assert [flat[b] for b in free] == [1 if kv["cached"][b] else 0 for b in free]   # cached-free / free
    assert (hm["zmin"], hm["zmax"]) == (-0.5, F.N_CATS - 0.5)  # fixed colour range
    text = sum(hm["text"], [])
    owner = next(iter(kv["block_tables"]))
    b = kv["block_tables"][owner][-1]
    assert owner in text[b] and "ref" in text[b]
    assert {t["name"] for t in traces(spec, "scatter")} >= {"free", "cached-free", "shared (ref>1)"}


def test_block_map_highlight_and_block_table(snap):
    kv = snap.kv
    # a request whose leading block came from the prefix cache (the runs share a one-block prefix)
    rid = next(r for r in kv["block_tables"] if kv["num_cached_tokens"].get(r, 0) >= kv["block_size"])
    table = kv["block_tables"][rid]
    spec = F.block_map_spec(kv, highlight=rid)
    check(spec)
    hi = traces(spec, "scatter")[-1]
    assert len(hi["x"]) == len(table)
    bt = F.block_table_spec(kv, rid)
    check(bt)
    (hm,) = traces(bt, "heatmap")
    cells = [c for row in hm["text"] for c in row if c]
    assert [c.rstrip("*") for c in cells] == [str(b) for b in table]   # logical order -> physical ids
    n_hit = kv["num_cached_tokens"][rid] // kv["block_size"]
    assert 1 <= n_hit < len(table)
    assert [c.endswith("*") for c in cells] == [i < n_hit for i in range(len(table))]   # * = prefix-cache hit
    assert "select a request" in F.block_table_spec(kv, None)["layout"]["annotations"][0]["text"]
    assert "holds no KV blocks" in F.block_table_spec(kv, "nope")["layout"]["annotations"][0]["text"]


def test_block_map_large_pool_is_grouped():
    n = 20000
    kv = dict(num_blocks=n, block_size=16, ref_counts=[1] * 5000 + [0] * (n - 5000), cached=[False] * n,
              block_tables={"r": list(range(5000))})
    spec = F.block_map_spec(kv)
    check(spec)
    (hm,) = traces(spec, "heatmap")
    assert sum(len(r) for r in hm["z"]) <= 4096 + 64
    assert "1 cell = 5 blocks" in spec["layout"]["title"]["text"]


def test_timeline_gantt_bars_with_base(snap):
    spec = F.timeline_spec(snap)
    check(spec)
    bars = {t["name"]: t for t in traces(spec, "bar") if t.get("orientation") == "h"}
    assert {"waiting", "prefill", "decode"} <= set(bars)
    for t in bars.values():
        assert len(t["x"]) == len(t["y"]) == len(t["base"])
        assert all(x > 0 for x in t["x"])
    ids = {r.request_id for r in snap.requests}
    assert set(bars["decode"]["y"]) <= ids and len(set(bars["decode"]["y"])) == len(snap.requests)
    # numeric axis, not dates
    assert isinstance(bars["prefill"]["base"][0], float)
    # batch composition subplot: one bar per step
    comp = traces(spec, "bar", "prefill tokens")[0]
    assert len(comp["x"]) == len(snap.steps)
    assert traces(spec, "scatter", "running") and traces(spec, "scatter", "waiting (queue)")


def test_timeline_step_axis_and_preemptions(engine_run, plain_snap):
    s = plain_snap
    preempted = [rid for e in engine_run.steps for rid in e.preempted]
    assert preempted and s.totals["preemptions"] == len(preempted)
    spec = F.timeline_spec(s, axis="step")
    check(spec)
    pre = traces(spec, "bar", "preempted")[0]
    assert sorted(pre["y"]) == sorted(preempted)               # one bar per preemption, on its request's row
    assert traces(spec, "scatter", "preemption")
    bases = traces(spec, "bar", "decode")[0]["base"]
    assert all(float(b).is_integer() for b in bases)           # whole steps on the step axis


def test_timings_stacked_regions_sum_to_wall(snap):
    spec = F.timings_spec(snap)
    check(spec)
    areas = [t for t in spec["data"] if t.get("stackgroup") == "regions"]
    names = [t["name"] for t in areas]
    assert {"attention", "mlp", "schedule", "sampling"} <= set(names)
    assert "forward" not in names                               # parent split into its parts
    total = np.sum([t["y"] for t in areas], axis=0)
    walls = [(s.end - s.start) * 1e3 for s in snap.steps[-len(total):]]
    assert np.allclose(total, walls, rtol=1e-6, atol=1e-6)


def test_step_regions_nesting():
    r = F.step_regions({"schedule": 1.0, "draft": 0.4, "forward": 5.0, "attention": 2.0, "mlp": 2.5}, wall=8.0)
    assert r == pytest.approx({"schedule": 0.6, "draft": 0.4, "forward (other)": 0.5, "attention": 2.0, "mlp": 2.5,
                               "unaccounted": 2.0})


def test_spec_panel_not_enabled_then_with_data(plain_snap, snap):
    off = F.spec_spec(plain_snap)
    check(off)
    assert "not enabled" in off["layout"]["annotations"][0]["text"] and not off["data"]
    on = F.spec_spec(snap)
    check(on)
    (bar,) = traces(on, "bar")
    assert len(bar["y"]) == 3 and all(0 <= v <= 1 for v in bar["y"])
    assert bar["y"][0] >= bar["y"][1] >= bar["y"][2]
    assert traces(on, "scatter", "acceptance rate") and traces(on, "scatter", "mean acceptance length")
    assert "mean acceptance length" in on["layout"]["title"]["text"]


def test_latency_histograms_are_precomputed(snap):
    spec = F.latency_spec(snap.records, bins=20)
    check(spec)
    bars = traces(spec, "bar")
    assert [b["name"] for b in bars] == ["TTFT", "TPOT", "ITL", "E2EL"]
    assert sum(bars[0]["y"]) == len(snap.records)               # every request binned once
    assert all(len(b["x"]) == 20 for b in bars)
    assert "empty" not in json.dumps(spec)
    assert "no finished requests" in F.latency_spec([])["layout"]["annotations"][0]["text"]


def test_throughput_and_kv_usage(snap, plain_snap, engine_run):
    spec = F.throughput_spec(snap)
    check(spec)
    kv = traces(spec, "scatter", "KV usage %")[0]
    assert kv["y"] == [100 * s.kv_usage for s in snap.steps]
    # the binned rates integrate to the tokens the engine produced and prefilled
    spec = F.throughput_spec(plain_snap)
    check(spec)
    gen, prompt = traces(spec, "scatter", "generation tok/s")[0], traces(spec, "scatter", "prompt tok/s")[0]
    width = gen["x"][1] - gen["x"][0]
    assert sum(gen["y"]) * width == pytest.approx(sum(len(o.token_ids) for o in engine_run.outputs.values()))
    assert sum(prompt["y"]) * width == pytest.approx(sum(s.num_prefill_tokens for s in engine_run.steps))


def test_profile_spec():
    rows = [dict(name="aten::mm", count=30, cpu_time_ms=3.0, device_time_ms=0.0),
            dict(name="_paged_attention_kernel", count=30, cpu_time_ms=1.0, device_time_ms=0.0)]
    spec = F.profile_spec(rows)
    check(spec)
    assert traces(spec, "bar")[0]["y"][0] == "aten::mm"
    assert F.profile_spec(None)["layout"]["annotations"]


def test_empty_snapshot_and_error_isolation(snap, monkeypatch):
    empty = Recorder().snapshot()
    for name, spec in F.build_specs(empty).items():
        check(spec)
    def boom(s):
        raise RuntimeError("broken builder")
    monkeypatch.setitem(F.SPECS, "timings", boom)
    specs = F.build_specs(snap)
    assert "broken builder" in specs["timings"]["layout"]["annotations"][0]["text"]
    assert specs["timeline"]["data"]                            # the others still drew


def test_build_all_returns_plotly_figures(snap):
    import plotly.graph_objects as go
    figs = F.build_all(snap)
    assert set(figs) == set(F.SPECS)
    assert all(isinstance(f, go.Figure) and f.layout.height for f in figs.values())


def test_payloads_stay_small(snap):
    sizes = {k: len(F.to_json(v)) for k, v in F.build_specs(snap).items()}
    assert max(sizes.values()) < 200_000, sizes


def test_timeline_names_multi_step_iterations(engine_run):
    from dataclasses import replace
    snap = engine_run.snapshot()
    snap.steps[-1] = replace(snap.steps[-1], num_decode_steps=8)
    hov = traces(F.timeline_spec(snap), "bar", "prefill tokens")[0]["hovertext"]
    assert hov[-1].endswith("8 decode iterations") and "iterations" not in " ".join(hov[:-1])


def test_timeline_explains_a_decode_blocks_length(engine_run):
    from dataclasses import replace
    snap = engine_run.snapshot()
    plan = dict(iteration_ms=5.0, budget_iterations=1, host_round_ms=21.0, cover_iterations=5)
    snap.steps[-1] = replace(snap.steps[-1], num_decode_steps=5, block_plan=plan)
    snap.steps[-2] = replace(snap.steps[-2], num_decode_steps=1, block_plan=dict(plan, cover_iterations=None))
    hov = traces(F.timeline_spec(snap), "bar", "prefill tokens")[0]["hovertext"]
    assert "5 decode iterations<br>5.0 ms an iteration: the budget allows 1, hiding the host's 21.0 ms" in hov[-1]
    assert "1 decode iteration<br>" in hov[-2] and "newcomers wait" in hov[-2]
    assert "iteration" not in " ".join(hov[:-2])

