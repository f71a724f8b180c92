"""profiler.py host: the engine's host work per decode iteration, phase by phase."""
import json


def test_host_profile_times_every_phase_of_an_iteration(tmp_path, monkeypatch):
    import benchmarks.common
    from benchmarks.profiler import main
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    for extra in ([], ["--skip-tokenizer-init"]):
        main(["host", "--batch", "12", "--out-len", "5", "--reps", "3", *extra])
    files = sorted(tmp_path.glob("profile_host_*.json"))
    assert len(files) == 2 and files[1].name.endswith("_notok.json")
    for f in files:
        d = json.loads(f.read_text())
        rows = {r["phase"]: r for r in d["rows"]}
        assert d["batch"] == 12
        assert set(rows) == {"schedule", "prepare", "process outputs", "encode", "marshal", "total"}
        parts = sum(r["ms"] for k, r in rows.items() if k != "total")
        assert all(r["ms"] > 0 for r in rows.values()) and rows["total"]["ms"] >= 0.5 * parts
