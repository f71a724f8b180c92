"""Several API server processes in front of one engine core: the core serves several attached clients, each its
own requests; one leaving aborts only its own; `--api-server-count 2` serves over HTTP, and its `/metrics` counts
every process's requests whichever process answers."""
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine import EngineConfig, SamplingParams
from engine.runtime.core_client import EngineCoreClient
from engine.runtime.core_proc import core_main

ROOT = Path(__file__).resolve().parents[1]
CFG = EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=128, block_size=16, max_model_len=512,
                   max_num_seqs=8)


@pytest.mark.slow
def test_attached_clients_get_their_own_outputs_and_one_leaving_aborts_only_its_requests():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=True) for _ in range(2)]
    core = ctx.Process(target=core_main, args=(CFG.to_dict(), [b for _, b in pipes]), daemon=True)
    core.start()
    for _, b in pipes:
        b.close()
    a, b = [EngineCoreClient(CFG, attach=x) for x, _ in pipes]
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        sa = a.submit_many([([5, 6, 7, 8], params, None), ([9, 10, 11], params, None)])
        sb = b.submit_many([([5, 6, 7, 8], params, None)])
        ra, rb = [s.result(timeout=120) for s in sa], sb[0].result(timeout=120)
        assert all(len(r.token_ids) == 6 for r in ra) and len(rb.token_ids) == 6
        assert list(ra[0].token_ids) == list(rb.token_ids)        # the same prompt, greedy: the same tokens
        assert a.healthy() and b.healthy()
        # a leaves with a long request unfinished: the core aborts it, b's request runs to its end
        a.submit([1, 2, 3], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        sb = b.submit([4, 5, 6], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        a.shutdown()
        assert len(sb.result(timeout=120).token_ids) == 40
        deadline = time.monotonic() + 60
        while b.stats().get("num_running", 1) and time.monotonic() < deadline:
            b.submit([7], SamplingParams(max_tokens=1)).result(timeout=60)    # a step refreshes the stats
        assert b.stats()["num_running"] == 0 and b.stats()["num_waiting"] == 0
        b.shutdown()
        core.join(30)
        assert core.exitcode == 0                                  # the last client left: the core exits
    finally:
        for c in (a, b):
            c.shutdown()
        if core.is_alive():
            core.kill()


def _start_two_api_servers(*extra: str) -> tuple[subprocess.Popen, str]:
    """`api_server --api-server-count 2 [extra]` on dummy:tiny -> (the launcher's process, its URL), healthy."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--port", str(port), "--model", "dummy:tiny",
           "--device", "cpu", "--num-kv-blocks", "128", "--max-model-len", "512", "--api-server-count", "2",
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    url = f"http://127.0.0.1:{port}"
    try:
        _healthy_within(proc, url, 240)
    except BaseException:
        proc.kill()
        raise
    return proc, url


@contextlib.contextmanager
def _two_api_servers(*extra: str):
    """_start_two_api_servers, stopped with an interrupt after, which must end it cleanly."""
    proc, url = _start_two_api_servers(*extra)
    try:
        yield proc, url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_the_launcher_stopped_or_killed_leaves_no_process_behind(how):
    """SIGTERM (a service manager's stop) ends the launcher as an interrupt does: exit 0, its engine core and API
    servers stopped first. Killed outright, it leaves them without a parent: they notice and exit."""
    import psutil
    proc, _ = _start_two_api_servers()
    kids = [p for p in psutil.Process(proc.pid).children() if p.name().startswith("kvscope-")]
    assert len(kids) == 3
    getattr(proc, how)()
    proc.wait(60)
    assert proc.returncode == (0 if how == "terminate" else -signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [(p.pid, p.name()) for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in kids:
        if p.is_running():
            p.kill()
    assert not left, f"still running after the launcher: {left}"


def _healthy_within(proc: subprocess.Popen, url: str, seconds: float) -> None:
    """/health answers 200 on several new connections (either process) within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "not healthy in time"
        try:
            if all(httpx.get(url + "/health", timeout=2).status_code == 200 for _ in range(4)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def _serve(url: str, n: int) -> None:
    for i in range(n):                              # new connections: the kernel spreads them over the processes
        r = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "dummy:tiny", "prompt": [3, 4, 5 + i], "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


@pytest.mark.slow
def test_api_server_count_two_serves_over_http():
    with _two_api_servers() as (_, url):
        _serve(url, 6)
        for _ in range(6):                          # a scrape on a new connection each: either process answers
            got = _samples(httpx.get(url + "/metrics", timeout=30).text)
            assert got["kvscope:request_success_total"] == 6
            assert got["kvscope:time_to_first_token_seconds_count"] == 6
            assert got["kvscope:request_generation_tokens_sum"] == 24


@pytest.mark.slow
def test_a_killed_engine_core_behind_two_api_servers_is_replaced():
    """`--api-server-count 2`: the engine core killed, the servers answer 503 meanwhile, the launcher starts a new
    core, each server attaches to it, and requests are served again."""
    import psutil
    with _two_api_servers() as (proc, url):
        def workers() -> dict:
            """The launcher's engine core and API servers by their process names (not multiprocessing's
            resource tracker)."""
            kids = [(p.name(), p) for p in psutil.Process(proc.pid).children()]
            return {name: p for name, p in kids if name.startswith("kvscope-")}

        _serve(url, 4)
        first = workers()
        assert sorted(first) == ["kvscope-api0", "kvscope-api1", "kvscope-core"]
        core = first["kvscope-core"]
        core.kill()
        deadline = time.monotonic() + 30           # not our child: poll until the launcher has reaped it
        while core.is_running() and core.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)                            # the servers' receivers see the pipe close
        _healthy_within(proc, url, 240)
        _serve(url, 6)
        now = workers()
        assert sorted(now) == sorted(first) and now["kvscope-core"].pid != core.pid


@pytest.mark.slow
def test_two_api_servers_in_front_of_two_replicas_and_one_replica_killed():
    """`--data-parallel-size 2 --api-server-count 2`: each server attaches to both engine cores, and requests one
    after another, spread by the kernel over the servers, reach both replicas (/metrics labels each). One replica's
    engine core killed: the launcher starts a new one, both servers attach to it, and both replicas serve again."""
    import psutil
    with _two_api_servers("--data-parallel-size", "2") as (proc, url):
        def cores() -> list:
            return [p for p in psutil.Process(proc.pid).children() if p.name() == "kvscope-core"]

        _serve(url, 4)
        text = httpx.get(url + "/metrics", timeout=30).text
        per = _per_replica_tokens(text)
        assert set(per) == {"0", "1"} and sum(per.values()) == 16 and min(per.values()) > 0
        assert _samples(text)["kvscope:request_success_total"] == 4
        first = cores()
        assert len(first) == 2
        first[1].kill()
        deadline = time.monotonic() + 30           # not our child: poll until the launcher has reaped it
        while first[1].is_running() and first[1].status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)                            # the servers' receivers see the pipe close
        _healthy_within(proc, url, 240)
        before = _per_replica_tokens(httpx.get(url + "/metrics", timeout=30).text)
        _serve(url, 8)
        after = _per_replica_tokens(httpx.get(url + "/metrics", timeout=30).text)
        now = cores()
        assert len(now) == 2 and first[0].pid in {p.pid for p in now} and first[1].pid not in {p.pid for p in now}
        assert all(after[e] > before.get(e, 0) for e in ("0", "1"))     # both replicas served again


def _per_replica_tokens(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.labels["engine"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "kvscope:generation_tokens_total"}


def _samples(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over its labels}."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_api_server_count_defaults_to_several_for_gpu_engines_without_tensor_parallelism():
    from engine.entrypoints.openai.api_server import GPU_API_SERVER_COUNT, default_api_server_count
    gpu = EngineConfig(model="dummy:tiny")                       # device "auto"
    assert default_api_server_count(gpu, True, 16, cuda=True) == GPU_API_SERVER_COUNT > 1
    assert default_api_server_count(gpu, True, 16, cuda=False) == 1                  # no GPU here
    assert default_api_server_count(EngineConfig(model="dummy:tiny", device="cpu"), True, 16, cuda=True) == 1
    assert default_api_server_count(gpu, False, 16, cuda=True) == 1                 # --no-engine-process
    assert default_api_server_count(gpu, True, 2 * GPU_API_SERVER_COUNT - 1, cuda=True) == 1   # too few cores
    assert default_api_server_count(gpu, True, None, cuda=True) == 1
    dp2 = EngineConfig(model="dummy:tiny", data_parallel_size=2)
    assert default_api_server_count(dp2, True, 16, cuda=True) == GPU_API_SERVER_COUNT
    assert default_api_server_count(dp2, True, 16, cuda=False) == 1
    assert default_api_server_count(EngineConfig(model="dummy:tiny", tensor_parallel_size=2), True, 16, cuda=True) == 1
