"""Calibrated load presets on this machine: measure the engine's capacity (inspector/load/capacity.py), size the
presets from it, run each in-process and report what it showed: the rate it was given, the waiting queue
after each engine step (peak, mean), the running batch, TTFT / E2EL and throughput. The steady presets should
keep the waiting queue short and TTFT near the unloaded value on a CPU and a GPU alike; *Overload* should not.

    python benchmarks/bench_presets.py [--model dummy:llama-3.2-1b] [--device cuda] [--presets "Steady Poisson,Overload"]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.runtime.async_engine import EngineLoop  # noqa: E402
from inspector import load as L  # noqa: E402
from inspector.recorder import Recorder  # noqa: E402

DEFAULT = ("Steady Poisson,Long prompts (chunked prefill),Many short chats,Shared system prompt (prefix caching),"
           "Multi-turn chat,Overload")


def run_preset(loop, rec, info, name: str, seed: int) -> dict:
    spec = L.preset(name, info, seed=seed)
    rec.clear()
    runner = L.LoadRunner(loop, spec, recorder=rec).start()
    runner.wait()
    steps = rec.snapshot().steps
    s = runner.summary()
    waiting = [st.num_waiting for st in steps] or [0]
    running = [st.num_running for st in steps] or [0]
    return dict(preset=name, rate=spec.rate, num_requests=spec.num_requests, completed=s["completed"],
                waiting_peak=max(waiting), waiting_mean=sum(waiting) / len(waiting), running_peak=max(running),
                ttft_p50_ms=s["TTFT"]["p50"], ttft_p99_ms=s["TTFT"]["p99"], e2el_p50_ms=s["E2EL"]["p50"],
                output_tok_s=s["output_throughput"], duration_s=s["duration_s"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, dummy:<preset>, or empty for the bundled SmolLM2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--presets", default=DEFAULT)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    loop = EngineLoop(EngineConfig(model=args.model, device=args.device)).start()
    try:
        rec = Recorder().attach(loop.engine.events)
        base = L.EngineInfo.from_loop(loop)
        tok = getattr(loop.engine, "tokenizer", None)
        cap = L.measure_capacity(loop, base.vocab_size, getattr(tok, "all_special_ids", None) or ())
        info = L.EngineInfo.from_loop(loop, cap)
        print(f"capacity measured in {cap.measured_in_s:.1f} s: {cap.describe(160, 80)}")
        results = [run_preset(loop, rec, info, n.strip(), args.seed) for n in args.presets.split(",")]
    finally:
        loop.shutdown()
    cols = list(results[0])
    print_table(results, cols)
    dev = device_name(args.device)
    path = write_json(f"presets_{slug(args.model or 'smollm2')}_{slug(dev)}",
                      dict(device=dev, model=args.model or "SmolLM2-135M-Instruct (bundled)",
                           capacity=cap.__dict__, loadavg_1min=os.getloadavg()[0], results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
