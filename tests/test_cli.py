"""The `kvscope` command (kvscope/cli.py): its subcommands, the server's flags through it, and the package's
metadata in step with requirements.txt and benchmarks/gpu.sh. Subprocesses only parse flags: no model loads."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope import cli

ROOT = Path(__file__).resolve().parents[1]


def kvscope(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "kvscope", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_help_lists_the_subcommands():
    out = kvscope("--help")
    assert out.returncode == 0, out.stderr
    for name in ("serve", "app", "bench"):
        assert re.search(rf"^\s+{name}\s", out.stdout, re.M), out.stdout


def test_serve_help_is_the_servers():
    out = kvscope("serve", "--help")
    assert out.returncode == 0, out.stderr
    for flag in ("--host", "--port", "--api-key", "--model", "--max-num-seqs", "--engine-process"):
        assert flag in out.stdout, f"{flag} missing from:\n{out.stdout}"


def test_unknown_subcommand_fails():
    out = kvscope("nope")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_bench_suites_are_gpu_sh_suites():
    text = (ROOT / "benchmarks" / "gpu.sh").read_text()
    suites = re.search(r"^SUITES=\(([^)]*)\)", text, re.M).group(1).split()
    assert tuple(suites) == cli.GPU_SUITES


def test_package_metadata_matches_requirements():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["kvscope"] == "kvscope.cli:main"
    declared = project["dependencies"] + project["optional-dependencies"]["test"]
    required = [ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert sorted(declared) == sorted(required)
