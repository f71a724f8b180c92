"""The inspector over data-parallel replicas: events of two real `dummy:tiny` CPU engines (engine_index 0 and 1) give
per-replica tracks, step coordinates, block maps, block tables, batch / queue panels and KV usage lines; the app's
EngineHost with data_parallel_size=2 routes load over both replicas with the API server's router, frees every
replica's blocks, and shows each replica; with one engine nothing of it appears."""
import copy
import json
from dataclasses import replace

import pytest

from engine import LLMEngine, SamplingParams
from engine.config import EngineConfig
from inspector import export as X
from inspector import figures as F
from inspector import load as L
from inspector.recorder import Recorder, kv_replicas
from webui.host import EngineHost

pytestmark = pytest.mark.usefixtures("one_thread")

BS = 16
LEAD = 6            # steps replica 0 runs alone before replica 1 gets its first request


def traces(spec, name=None, type_=None):
    return [d for d in spec["data"] if (name is None or d.get("name") == name) and (type_ is None or d["type"] == type_)]


def notes(spec) -> list[str]:
    return [a["text"] for a in spec["layout"].get("annotations", [])]


@pytest.fixture(scope="module")
def two_replicas():
    """Two engines stepped by hand, replica 1 starting LEAD steps late; requests r0, r2, r4 on replica 0 and r1, r3,
    r5 on replica 1, each after the first sharing its replica's one-block prefix. -> (engines, snapshot)."""
    engines = [LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=24, block_size=BS, engine_index=r)
               for r in range(2)]
    rec = Recorder().attach(*(e.events for e in engines))
    prefix = [list(range(100, 100 + BS)), list(range(300, 300 + BS))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    pending = {0: [0, 2, 4], 1: [1, 3, 5]}
    kv, most, step = None, -1, 0
    while any(pending.values()) or any(e.has_unfinished_requests() for e in engines):
        for r, eng in enumerate(engines):
            if pending[r] and step % 3 == 0 and (r == 0 or step >= LEAD):
                i = pending[r].pop(0)
                eng.add_request(prefix[r] + [500 + i] * (3 + i), sp, request_id=f"r{i}")
            if eng.has_unfinished_requests():
                eng.step()
        held = [len(e.kv_snapshot()["block_tables"]) for e in engines]
        if min(held) > 0 and sum(held) > most:
            most, kv = sum(held), {"replicas": [e.kv_snapshot() for e in engines]}
        step += 1
    assert kv is not None
    return engines, rec.snapshot(kv=copy.deepcopy(kv))


def test_tracks_carry_their_replica_and_its_own_step_coordinates(two_replicas):
    engines, snap = two_replicas
    assert snap.num_replicas == 2
    assert {r.request_id: r.engine_index for r in snap.requests} == {f"r{i}": i % 2 for i in range(6)}
    assert {s.engine_index for s in snap.steps} == {0, 1}
    r1 = snap.request_map["r1"]
    assert r1.arrival_step == 0.0                   # replica 1 had run no step, although replica 0 had run LEAD
    for tr in snap.requests:
        assert max(sp.step_end for sp in tr.spans) <= engines[tr.engine_index].step_index + 1
    assert snap.request_map["r3"].num_cached_tokens == BS       # the prefix cached on its own replica


def test_block_map_and_block_table_per_replica(two_replicas):
    _, snap = two_replicas
    pools = kv_replicas(snap.kv)
    spec = F.block_map_spec(snap.kv)
    F.as_figure(spec)
    maps = traces(spec, "blocks", "heatmap")
    assert [(m["xaxis"], m["yaxis"]) for m in maps] == [("x", "y"), ("x2", "y2")]
    for r, kv in enumerate(pools):
        in_use = sum(1 for c in kv["ref_counts"] if c > 0)
        assert f"replica {r} · {in_use}/{kv['num_blocks'] - 1} blocks in use" in " ".join(notes(spec))
        assert all(t.startswith(f"replica {r} · block") for row in maps[r]["text"] for t in row if t)
    rid = next(iter(pools[1]["block_tables"]))
    hl = F.block_map_spec(snap.kv, highlight=rid)
    (mark,) = traces(hl, f"{rid} (logical index)")
    assert mark["xaxis"] == "x2" and len(mark["x"]) == len(pools[1]["block_tables"][rid])
    table = F.block_table_spec(snap.kv, rid)
    F.as_figure(table)
    assert table["layout"]["title"]["text"].startswith(f"Block table (replica 1): {rid}")
    cells = [int(t.rstrip("*")) for row in table["data"][0]["text"] for t in row if t]
    assert cells == pools[1]["block_tables"][rid]


def test_timeline_groups_requests_by_replica_with_a_batch_panel_each(two_replicas):
    _, snap = two_replicas
    for axis in ("time", "step"):
        spec = F.timeline_spec(snap, axis=axis)
        F.as_figure(spec)
        order = spec["layout"]["yaxis"]["categoryarray"]          # bottom up: replica 1's group, then replica 0's
        assert order == ["r5", "r3", "r1", "r4", "r2", "r0"]
        assert {"replica 0", "replica 1", "replica 0: batch and queue", "replica 1: batch and queue"} <= set(notes(spec))
        gantt = [h for d in traces(spec, type_="bar") if d.get("orientation") == "h" for h in d["hovertext"]]
        assert gantt and all(f"replica {int(h[1]) % 2}" in h for h in gantt)
        running = traces(spec, "running")
        assert len(running) == 2 and running[0]["yaxis"] != running[1]["yaxis"]
        for r, line in enumerate(running):
            assert line["y"] == [s.num_running for s in snap.steps if s.engine_index == r]
        assert [d.get("showlegend", True) for d in running] == [True, False]


def test_throughput_memory_and_timings_per_replica(two_replicas):
    _, snap = two_replicas
    tp = F.throughput_spec(snap)
    for r in range(2):
        (usage,) = traces(tp, f"replica {r} KV usage %")
        assert usage["y"] == [100 * s.kv_usage for s in snap.steps if s.engine_index == r]
        assert len(traces(tp, f"replica {r} waiting")) == 1
    mem, tim = F.memory_spec(snap), F.timings_spec(snap)
    for spec in (tp, mem, tim):
        F.as_figure(spec)
    assert len({d["yaxis"] for d in traces(mem, "allocated")}) == 2
    assert len({d["yaxis"] for d in traces(tim, "attention")}) == 2


def test_exports_put_each_replicas_steps_on_its_own_track(two_replicas):
    _, snap = two_replicas
    df = X.steps_frame(snap)
    assert df["engine_index"].tolist() == [s.engine_index for s in snap.steps]
    trace = X.chrome_trace(snap)["traceEvents"]
    for r in range(2):
        steps = [e for e in trace if e.get("cat") == "step" and e["tid"] == 2 * r + 1]
        assert [e["name"] for e in steps] == [f"step {s.step}" for s in snap.steps if s.engine_index == r]
        assert {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2 * r + 1,
                "args": {"name": f"replica {r} steps"}} in trace
        assert any(e["name"] == f"replica {r} KV usage" and e["ph"] == "C" for e in trace)


def test_one_engine_shows_no_replicas(engine_run):
    snap = engine_run.snapshot()
    assert snap.num_replicas == 1
    specs = F.build_specs(snap)
    specs["block_table"] = F.block_table_spec(snap.kv, next(iter(snap.kv["block_tables"])))
    for name, spec in specs.items():
        assert "replica" not in json.dumps(spec), name
    assert len(traces(specs["block_map"], "blocks")) == 1
    assert sorted(k for k in specs["timeline"]["layout"] if k.startswith("yaxis")) == ["yaxis", "yaxis2", "yaxis3"]
    assert [d["name"] for d in traces(specs["throughput"]) if "KV" in d["name"]] == ["KV usage %"]
    assert "replica" not in X.chrome_trace_json(snap) and "engine_index" not in X.steps_frame(snap)


@pytest.fixture(scope="module")
def host():
    cfg = EngineConfig(model="dummy:tiny", device="cpu", data_parallel_size=2, num_kv_blocks=40, max_num_seqs=4)
    h = EngineHost(cfg, refresh_s=3600).start()
    yield h
    h.shutdown()


def run_load(loop, recorder, **kw) -> None:
    spec = L.LoadSpec(rate=float("inf"), prompt_len=L.LengthDist("uniform", 8, 24), output_len=L.LengthDist("fixed", 6, 6),
                      **kw)
    runner = L.LoadRunner(loop, spec, recorder=recorder).start()
    assert runner.wait(120) and runner.progress()["finished"] == spec.num_requests


def test_host_routes_load_over_both_replicas_and_frees_their_blocks(host):
    loop = host.require_loop()
    assert "2 data-parallel replicas" in host.describe() and len(loop.engines) == 2
    run_load(loop, host.recorder, num_requests=8, seed=1)
    # equally loaded replicas take turns: the second request goes to replica 1 whether or not the first finished
    assert {r.engine_index for r in host.publish().snapshot.requests} == {0, 1}
    routed = loop.router.prefix_routed
    run_load(loop, host.recorder, num_requests=4, seed=2, shared_prefix_len=2 * BS)
    assert loop.router.prefix_routed > routed      # the second request joins the first one's cached prefix
    pub = host.publish()
    homes = {r.request_id: r.engine_index for r in pub.snapshot.requests}
    assert len(homes) == 12
    per = pub.stats["replicas"]
    assert [s["finished"] for s in per] == [sum(1 for e in homes.values() if e == r) for r in range(2)]
    assert [s["num_free_blocks"] for s in per] == [s["num_blocks"] - 1 for s in per]
    assert [len(kv["block_tables"]) for kv in kv_replicas(pub.kv)] == [0, 0]
    line = host.status_line()
    for r, st in enumerate(per):                   # each replica's own step count: they step apart
        assert f"replica {r}: step {st['step']}, running 0, waiting 0" in line
    assert " · step " not in line
    plots = {k: json.loads(v) for k, v in pub.plots.items()}
    assert len(traces(plots["block_map"], "blocks")) == 2
    assert len(traces(plots["timeline"], "running")) == 2
    assert len(traces(plots["throughput"], "replica 1 KV usage %")) == 1


def test_memory_pressure_preset_loads_every_replica(host):
    info = host.engine_info(measure=False)
    assert info.num_replicas == 2
    one = L.preset("Memory pressure (preemption)", replace(info, num_replicas=1))
    assert L.preset("Memory pressure (preemption)", info).num_requests == 2 * one.num_requests


def test_host_restarts_with_one_engine_and_shows_no_replicas(host):
    host.restart(host.config.replace(data_parallel_size=1))
    assert len(host.loop.engines) == 1 and "replica" not in host.describe()
    host.loop.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), timeout=60)
    pub = host.publish()
    assert pub.snapshot.num_replicas == 1 and "replicas" not in pub.kv
    for name in ("block_map", "timeline", "throughput", "memory", "timings"):
        assert "replica" not in pub.plots[name], name
