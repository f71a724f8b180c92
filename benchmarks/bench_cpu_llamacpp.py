"""kvscope vs llama.cpp on CPU: the bundled SmolLM2-135M-Instruct GGUF, one prompt, N new tokens greedy with EOS
ignored, batch 1 and B requests at once (aggregate tok/s). llama.cpp runs through llama-cpp-python (optional,
benchmark-only: `CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python` builds it from source), batch 1 only
(its single stream is the reference for the batched figure). The engines alternate run by run and each keeps its
best, so load from other processes on a shared box hits both alike.

    python benchmarks/bench_cpu_llamacpp.py [--tokens 128] [--batch 8] [--repeats 3] [--quantization int4 none]
        [--decode-layer on off]

--decode-layer: the int4 decode step's layers as one C++ call each (`cpu_decode_layer`, the default) and/or the
layer's torch ops. The seconds each engine took to start are reported.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, write_json  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea,"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return "?"


def threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Kvscope:
    def __init__(self, quantization: str | None, decode_layer: bool = True):
        from engine import LLM, SamplingParams
        self.name = f"kvscope {quantization or 'fp32'}" + ("" if decode_layer else " torch-op layers")
        extra = {"int4_group_size": 32} if quantization == "int4" else {}   # the GGUF's Q4_1 groups
        t = time.perf_counter()
        self.llm = LLM(device="cpu", quantization=quantization, max_model_len=1024, cpu_decode_layer=decode_layer, **extra)
        self.start_s = time.perf_counter() - t
        self.params = SamplingParams

    def run(self, tokens: int, batch: int) -> float:
        """-> aggregate new tokens per second of `batch` copies of PROMPT submitted at once."""
        p = self.params(temperature=0, max_tokens=tokens, min_tokens=tokens)   # min_tokens = tokens: EOS ignored
        t = time.perf_counter()
        outs = self.llm.generate([PROMPT] * batch, p, use_tqdm=False)
        dt = time.perf_counter() - t
        return sum(len(o.token_ids) for o in outs) / dt


class LlamaCpp:
    def __init__(self, gguf: Path):
        from llama_cpp import Llama
        self.name = "llama.cpp"
        self.llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads(), n_batch=512, verbose=False)
        self.prompt = self.llm.tokenize(PROMPT.encode())

    def run(self, tokens: int, batch: int) -> float:
        assert batch == 1
        self.llm.reset()
        t = time.perf_counter()
        n = 0
        for tok in self.llm.generate(self.prompt, top_k=1, temp=0.0, reset=True):   # greedy; EOS not checked
            n += 1
            if n == tokens:
                break
        return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="alternating runs per engine and batch; best is kept")
    ap.add_argument("--quantization", nargs="+", default=["int4", "none"], help="kvscope weight formats to run")
    ap.add_argument("--decode-layer", nargs="+", default=["on"], choices=["on", "off"],
                    help="int4 decode: a layer as one C++ call (kvscope::decode_layer), the torch ops, or both")
    args = ap.parse_args()
    load_before = os.getloadavg()
    from engine.models.bundled import gguf_path
    engines = [Kvscope(None if q == "none" else q, d == "on") for q in args.quantization for d in args.decode_layer
               if d == "on" or q == "int4"]                   # the layer op serves int4 decode steps only
    starts = {e.name: round(e.start_s, 1) for e in engines}
    try:
        engines.insert(0, LlamaCpp(gguf_path()))
    except ImportError:
        print("llama-cpp-python is not installed: kvscope only", file=sys.stderr)
    best: dict[tuple[str, int], float] = {}
    for e in engines:                                       # warm-up: first-call allocations, thread pools
        e.run(8, 1)
    for _ in range(args.repeats):
        for batch in (1, args.batch):
            for e in engines:                               # interleaved: noise from other processes hits both
                if batch > 1 and isinstance(e, LlamaCpp):
                    continue
                key = (e.name, batch)
                best[key] = max(best.get(key, 0.0), e.run(args.tokens, batch))
    ref = best.get(("llama.cpp", 1))
    rows = [{"engine": name, "batch": b, "tok/s": round(v, 1), "x llama.cpp b1": round(v / ref, 2) if ref else None}
            for (name, b), v in best.items()]
    print_table(rows, ["engine", "batch", "tok/s", "x llama.cpp b1"])
    load = {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in os.getloadavg()]}
    print("seconds to start:", starts)
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']} on {threads()} cores")
    path = write_json("cpu_vs_llamacpp", {"device": device_name("cpu"), "threads": threads(), "commit": commit(),
                                          "tokens": args.tokens, "prompt": PROMPT, "repeats": args.repeats,
                                          "command": " ".join(sys.argv), "load_average": load, "start_s": starts, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
