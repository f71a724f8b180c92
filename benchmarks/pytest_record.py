"""A pytest plugin that records a test run as a result: outcomes per test file, as a table after pytest's
summary and as benchmarks/results/gpu_tests_<device>.json (benchmarks/gpu.sh tests loads it).

    python -m pytest -p benchmarks.pytest_record tests/test_gpu_engine.py ...
"""
from __future__ import annotations

import contextlib
import io
from collections import Counter, defaultdict

OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    from benchmarks.common import device_name, print_table, slug, write_json
    per_file: dict[str, Counter] = defaultdict(Counter)
    failed = []
    for outcome in OUTCOMES:
        for rep in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(rep, "nodeid", None)
            if not nodeid:
                continue
            per_file[nodeid.split("::")[0]][outcome] += 1
            if outcome in ("failed", "error"):
                failed.append(nodeid)
    rows = [dict(file=f, **c) for f, c in sorted(per_file.items())]
    dev = device_name()
    path = write_json(f"gpu_tests_{slug(dev)}", dict(device=dev, exitstatus=int(exitstatus), rows=rows,
                                                     failed=failed))
    terminalreporter.write_sep("=", f"{dev}: {path.name}")
    if not rows:
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(rows, ["file", *(o for o in OUTCOMES if any(o in r for r in rows))])
    for line in out.getvalue().splitlines():
        terminalreporter.write_line(line)
