"""How parallel engines start and stop, on CPU (gloo): a plain script without an `if __name__ == "__main__"`
guard runs TP=2 and DP=2 (workers and engine processes are fresh interpreters that never import it); torchrun
starts the ranks itself (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a killed rank is reported
with its rank and the engine stops, within a bounded time. Every run gives one rank's greedy tokens."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from engine import EngineConfig, SamplingParams
from engine.runtime.async_engine import EngineLoop

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[(7 * i + 3 * j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(4)]

# module level, no __main__ guard: as users write scripts
SCRIPT = """
import json, sys
from engine import LLM, SamplingParams
sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
prompts = {prompts}
out = {{}}
for name, kw in {runs}:
    llm = LLM("dummy:tiny", device="cpu", dtype="float32", **kw)
    out[name] = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    llm.close()
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def run_script(tmp_path: Path, runs: list, launcher: list[str] | None = None) -> dict:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT.format(prompts=PROMPTS, runs=runs))
    result = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = (launcher or [sys.executable]) + [str(script), str(result)]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_plain_script_without_main_guard_tp2_and_dp2_match_one_rank(tmp_path):
    out = run_script(tmp_path, [("one", {}), ("tp2", dict(tensor_parallel_size=2)),
                                ("dp2", dict(data_parallel_size=2))])
    assert out["tp2"] == out["one"] and out["dp2"] == out["one"]
    assert len({tuple(t) for t in out["one"]}) > 1


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs torchrun")
def test_torchrun_launch_tp2_matches_one_rank(tmp_path):
    """`torchrun --nproc-per-node 2 script.py`: rank 0 runs the engine, rank 1 serves as its worker inside
    LLM(...) and exits when rank 0 closes; the output file is rank 0's."""
    from engine import LLM
    llm = LLM("dummy:tiny", device="cpu", dtype="float32")          # one rank, in this process
    ref = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                             use_tqdm=False)]
    llm.close()
    with socket.socket() as s:                      # torchrun passes --master-port to the ranks as it is
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = ["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(port)]
    out = run_script(tmp_path, [("tp2", dict(tensor_parallel_size=2))], launcher)
    assert out["tp2"] == ref


@pytest.mark.slow
def test_killed_rank_is_reported_and_the_engine_stops_within_10_s(monkeypatch):
    """The error names the rank and ends with the worker's last stderr lines (here faulthandler's report)."""
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")        # inherited by the worker
    loop = EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", dtype="float32", tensor_parallel_size=2,
                                   max_num_batched_tokens=8)).start()
    try:
        (pid,) = loop.engine.executor.pids
        stream = loop.submit(list(range(10, 60)), SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
        next(iter(stream))
        os.kill(pid, signal.SIGSEGV)
        with pytest.raises(RuntimeError, match=r"tensor parallel: rank 1 \(pid \d+\) exited with code -11") as e:
            stream.result(timeout=10.0)                 # a hang fails here, not after the collective timeout
        msg = str(e.value)
        assert "rank 1 stderr" in msg and "(most recent call first)" in msg, msg
    finally:
        loop.shutdown()
        loop.engine.close()
