"""The processes around a serving benchmark: kvscope's server launched for it, another server started by a
shell command (`--launch`), a wait until a started server answers, and py-spy recording a server while a
workload runs."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

from benchmarks.common import RESULTS, free_port, slug

ROOT = Path(__file__).resolve().parents[1]


def wait_ready(proc: subprocess.Popen, probe: Callable[[], bool], timeout: float, period: float = 0.5) -> bool:
    """Call `probe()` every `period` s until it returns True (-> True); an HTTP error or a malformed answer counts
    as not ready yet. False when `proc` exits or `timeout` s pass first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            if probe():
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(period)
    return False


def launch_server(args) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    cmd = [sys.executable, "-m", "engine.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--device", args.device, "--log-level", "warning",
           "--max-waiting-requests", str(max(256, args.num_prompts))]
    if args.model:
        cmd += ["--model", args.model]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    cmd += args.server_arg
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvscope_bench_serve_{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    print(f"launching: {' '.join(cmd)}  (log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, cwd=str(ROOT), env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            process_group=0)        # stop_process signals its whole group
    url = f"http://127.0.0.1:{port}"
    if wait_ready(proc, lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 300):
        return proc, url, log_path
    if proc.poll() is not None:
        raise SystemExit(f"the server exited ({proc.returncode}); see {log_path}:\n{log_path.read_text()[-2000:]}")
    proc.terminate()
    raise SystemExit(f"the server did not become healthy in 300 s; see {log_path}")


def start_command(name: str, cmd: str, url: str) -> subprocess.Popen:
    """Start another server (`--launch`) in its own process group and wait until it lists its models."""
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_serve_{slug(name)}.log"
    print(f"launching {name}: {cmd}  (log: {log_path})", flush=True)
    proc = subprocess.Popen(cmd, shell=True, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            process_group=0)
    models = url.rstrip("/").removesuffix("/v1") + "/v1/models"
    if wait_ready(proc, lambda: httpx.get(models, timeout=2).status_code == 200, 600, period=1.0):
        return proc
    if proc.poll() is not None:
        raise SystemExit(f"{name} exited ({proc.returncode}); see {log_path}:\n{log_path.read_text()[-2000:]}")
    stop_process(proc)
    raise SystemExit(f"{name} did not answer /v1/models in 600 s; see {log_path}")


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(10)


def start_pyspy(pid: int, out: Path) -> subprocess.Popen:
    """py-spy sampling every thread of `pid` (idle ones too, so waits show) until stopped with SIGINT."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                             "--threads", "--idle", "--nonblocking", "--subprocesses", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def stop_launched(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
