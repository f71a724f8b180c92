"""Code structure: every module imports on its own, the layers only import downward, and the import graph of
the project's own modules (engine, inspector, webui, benchmarks, kvscope, app) has no cycle.

The layering and cycle checks read the source with `ast` (nothing is imported), so they take milliseconds.
The import check starts one fresh interpreter per package (all at once) that imports each of its modules.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "inspector", "webui", "benchmarks", "kvscope")
TOP_MODULES = ("app",)

# top-level names each layer must not import (directly, lazily, or under TYPE_CHECKING)
FORBIDDEN = {
    "engine": {"inspector", "webui", "app", "kvscope", "gradio", "plotly"},
    "inspector": {"gradio", "webui", "app", "kvscope"},
}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the project (packages as `pkg`, not `pkg.__init__`)."""
    files = {}
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*.py")):
            parts = p.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = p
    for m in TOP_MODULES:
        if (root / f"{m}.py").exists():
            files[m] = root / f"{m}.py"
    return files


def import_statements(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """Every import in the file, anywhere (function bodies and `if TYPE_CHECKING:` blocks included), as
    (absolute module, imported names): `import a.b` -> ("a.b", []), `from ..x import y` -> ("pkg.x", ["y"])."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((base, [a.name for a in node.names]))
    return out


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports. `from pkg import sub` points at `pkg.sub` when that is a
    module, else at `pkg`; a parent package that Python runs implicitly (`pkg` for `import pkg.sub`) is not
    an edge."""
    files = module_files(root)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for base, names in import_statements(name, path):
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in files]
            if base in files and len(subs) < len(names) or not names:
                subs.append(base)
            targets.update(t for t in subs if t in files and t != name)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge found by a depth-first search (empty when the graph is acyclic)."""
    cycles, state = [], {}

    def visit(u: str, stack: list[str]) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for m in sorted(graph):
        if not state.get(m):
            visit(m, [])
    return cycles


def layering_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for name, path in module_files(root).items():
        forbidden = FORBIDDEN.get(name.partition(".")[0])
        if not forbidden:
            continue
        for base, _ in import_statements(name, path):
            if base.partition(".")[0] in forbidden:
                bad.append(f"{path.relative_to(root).as_posix()} imports {base}")
    return bad


# ---- the checks --------------------------------------------------------------------------------------------

_IMPORT_ALL = r"""
import importlib, json, sys, traceback
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        failed[name] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


@pytest.mark.slow
def test_every_module_imports_on_its_own():
    """One fresh interpreter per package (started together), importing each of its modules by name. app.py
    goes with webui (both import gradio). Every module imports on CPU; none is skipped."""
    by_pkg: dict[str, list[str]] = {}
    for name in module_files():
        group = "webui" if name in TOP_MODULES else name.partition(".")[0]
        by_pkg.setdefault(group, []).append(name)
    env = dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", GRADIO_ANALYTICS_ENABLED="False", PYTHONDONTWRITEBYTECODE="1")
    procs = {pkg: subprocess.Popen([sys.executable, "-c", _IMPORT_ALL, *names], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for pkg, names in by_pkg.items()}
    problems = []
    for pkg, p in procs.items():
        out, err = p.communicate(timeout=120)
        try:
            failed = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            problems.append(f"{pkg}: the importer crashed (rc={p.returncode}):\n{err[-2000:]}")
            continue
        problems += [f"{name}:\n{tb}" for name, tb in failed.items()]
    assert not problems, "modules that do not import on their own:\n" + "\n".join(problems)


def test_layers_import_only_downward():
    assert not layering_violations(), "\n".join(layering_violations())


def test_project_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 20 and graph["app"], "the import graph came out empty: module discovery is broken"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---- the checkers themselves can fail ----------------------------------------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_checkers_catch_a_cycle_and_an_upward_import(tmp_path):
    _write(tmp_path, {
        "engine/__init__.py": "",
        "engine/a.py": "from .b import thing\n",
        "engine/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.c import C\n",
        "engine/c.py": "def f():\n    import engine.a\n    from inspector import figures\n",
        "inspector/__init__.py": "",
        "inspector/figures.py": "import gradio\n",
        "webui/__init__.py": "",
        "benchmarks/__init__.py": "",
        "app.py": "from engine import a\n",
    })
    graph = import_graph(tmp_path)
    assert graph["app"] == {"engine.a"}                   # `from engine import a`: the submodule, not engine
    cycles = find_cycles(graph)
    assert cycles and set(cycles[0]) == {"engine.a", "engine.b", "engine.c"}
    assert layering_violations(tmp_path) == ["engine/c.py imports inspector", "inspector/figures.py imports gradio"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
