"""The `kvscope` command, subcommands as vLLM's `vllm` has them:

    kvscope serve [flags]          the OpenAI-compatible API server (engine.entrypoints.openai.api_server)
    kvscope app [flags]            the Gradio playground and inspector, with the API (app.py)
    kvscope bench SUITE [args]     a GPU suite: benchmarks/gpu.sh SUITE
    kvscope bench SCRIPT [args]    else benchmarks/bench_SCRIPT.py, SCRIPT.py or SCRIPT: `kvscope bench serve
                                   --device cpu`, `kvscope bench profile decode`, `kvscope bench bench_spec.py`
                                   (the script where a suite has its short name)
`bench` runs from a source checkout (`pip install -e .`): the benchmarks are not installed.

Each subcommand hands the rest of the command line to its program: `kvscope serve --help` lists the server's
flags. This package sits above engine, inspector, webui and app; none of them imports it.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

GPU_SUITES = ("tests", "kernels", "offline", "serving", "quant", "spec", "structured", "tp", "kv", "lessons")


def serve(argv: list[str]) -> None:
    from engine.entrypoints.openai.api_server import main
    main(argv)


def app(argv: list[str]) -> None:
    from app import main
    main(argv)


def benchmarks_dir() -> Path:
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if not (folder / "gpu.sh").is_file():
        raise SystemExit(f"kvscope bench: no benchmarks/ at {folder.parent}: the benchmarks run from a source "
                         "checkout (pip install -e .)")
    return folder


def bench_scripts(folder: Path) -> list[str]:
    """The names `kvscope bench` runs each script by (its file name where a GPU suite has the short one)."""
    names = []
    for p in sorted(folder.glob("*.py")):
        if p.stem.startswith(("bench_", "sweep_")) or p.stem in ("profile", "lessons", "soak"):
            short = p.stem.removeprefix("bench_")
            names.append(p.name if short in GPU_SUITES else short)
    return names


def bench(argv: list[str]) -> None:
    folder = benchmarks_dir()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvscope bench SUITE|SCRIPT [ARGS...]\n\nGPU suites (benchmarks/gpu.sh SUITE):\n  "
              + " ".join(GPU_SUITES) + "\nscripts (benchmarks/bench_SCRIPT.py, SCRIPT.py or SCRIPT):\n  "
              + " ".join(bench_scripts(folder)))
        return
    name, rest = argv[0], argv[1:]
    if name in GPU_SUITES:
        os.execvp("bash", ["bash", str(folder / "gpu.sh"), name, *rest])
    for script in (folder / f"bench_{name}.py", folder / f"{name}.py", folder / name):
        if script.suffix == ".py" and script.is_file():
            os.execv(sys.executable, [sys.executable, str(script), *rest])
    raise SystemExit(f"kvscope bench: {name!r} is neither a GPU suite ({', '.join(GPU_SUITES)}) nor a script "
                     f"under {folder}")


COMMANDS = {"serve": (serve, "run the OpenAI-compatible API server"),
            "app": (app, "run the Gradio playground and inspector (with the API)"),
            "bench": (bench, "run a benchmark suite or script (from a source checkout)")}


def build_parser() -> argparse.ArgumentParser:
    """For --help and errors only: each subcommand parses its own flags."""
    ap = argparse.ArgumentParser(prog="kvscope", description="kvscope: an LLM inference engine you can see into",
                                 epilog="`kvscope COMMAND --help` lists the command's flags.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, about) in COMMANDS.items():
        sub.add_parser(name, help=about, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)         # prints the help, or the error for an unknown command
        return
    COMMANDS[argv[0]][0](argv[1:])
