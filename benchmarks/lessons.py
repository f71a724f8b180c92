"""The Lessons as a script (the same sweeps as the app's Lessons tab): runs each on one model and device, prints
its measured ratios and writes every result as JSON (no plotly needed; with plotly and kaleido installed,
`--png DIR` also writes each chart as a PNG).

    python benchmarks/lessons.py --model dummy:tiny --device cpu                 # small sweeps, seconds
    python benchmarks/lessons.py --model dummy:llama-3.2-1b                      # on a GPU: large sweeps
    python benchmarks/lessons.py --model dummy:llama-3.2-1b --lessons graph_timing   # CUDA-graph timing cost

`graph_timing` (CUDA only) measures what EngineConfig.graph_timing_interval costs: decode throughput with the
timer observing every step, graphs replayed, and every N-th step run eagerly under the timer, against N = 0.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import device_name, slug, write_json, write_png  # noqa: E402
from inspector.lessons import LESSONS, Setup, run_lesson  # noqa: E402
from inspector.lessons.common import greedy, random_prompts, run  # noqa: E402


def graph_timing(setup: Setup, interval: int, batch: int = 64, output_len: int = 256, repeats: int = 3) -> dict:
    """Decode tok/s with graph_timing_interval = 0 and = `interval` (interleaved repeats, best of each)."""
    arms = {0: [], interval: []}
    engines = {n: setup.engine(graph_timing_interval=n, max_num_seqs=batch, max_model_len=output_len + 64,
                               num_kv_blocks=batch * (-(-(output_len + 64) // 16)) + 2, num_scheduler_steps=1,
                               enable_prefix_caching=False) for n in arms}
    sampled = 0
    for rep in range(repeats):
        for n, eng in engines.items():
            r = run(eng, random_prompts(batch, 32, eng.arch_config.vocab_size, rep), greedy(output_len))
            dec = [s for s in r.steps if s.num_prefill_tokens == 0]
            arms[n].append(sum(s.num_decode_tokens for s in dec) / sum(s.end - s.start for s in dec))
            if n:
                sampled += sum(s.timings_sampled for s in dec)
    for eng in engines.values():
        eng.close()
    base, timed = max(arms[0]), max(arms[interval])
    return dict(lesson="graph_timing", interval=interval, batch=batch, decode_tok_s_untimed=base,
                decode_tok_s_sampled=timed, overhead_pct=100 * (1 - timed / base), sampled_steps=sampled)


def write_lesson_png(res: dict, folder: Path, name: str) -> None:
    from inspector.figures import as_figure, lesson_spec
    folder.mkdir(parents=True, exist_ok=True)
    print(f"{name}: PNG via {write_png(as_figure(lesson_spec(res)), folder / f'lesson_{name}.png', 1100, 420)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or preset (dummy:llama-3.2-1b); default: bundled SmolLM2")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--scale", default="auto", choices=["auto", "small", "large"])
    ap.add_argument("--lessons", default=",".join(LESSONS), help=f"comma-separated: {','.join(LESSONS)},graph_timing")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a shared 2-core box)")
    ap.add_argument("--graph-timing-interval", type=int, default=200)
    ap.add_argument("--png", default=None, help="also write each chart as PNG here (needs plotly; kaleido or "
                    "playwright + /usr/bin/chromium)")
    ap.add_argument("--render", default=None, help="no runs: draw a results JSON written earlier (e.g. on a GPU "
                    "machine without plotly) as PNGs under --png")
    ap.add_argument("--out", default=None, help="results/<name>.json; default lessons_<model>_<device>")
    a = ap.parse_args()
    if a.render:
        for name, res in json.loads(Path(a.render).read_text())["results"].items():
            if name != "graph_timing":
                write_lesson_png(res, Path(a.png or "."), name)
        return
    if a.threads:
        torch.set_num_threads(a.threads)
    setup = Setup(model=a.model, device=a.device, dtype=a.dtype, scale=a.scale)
    results = {}
    for name in a.lessons.split(","):
        t0 = time.perf_counter()
        if name == "graph_timing":
            if not setup.cuda:
                print("graph_timing: needs CUDA, skipped")
                continue
            res = graph_timing(setup, a.graph_timing_interval)
        else:
            res = run_lesson(name, setup)
        res["seconds"] = time.perf_counter() - t0
        results[name] = res
        summary = res.get("summary", {k: v for k, v in res.items() if k != "lesson"})
        print(f"{name:16s} {res['seconds']:7.1f} s  " + "  ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()), flush=True)
        if a.png and name != "graph_timing":
            write_lesson_png(res, Path(a.png), name)
    name = a.out or f"lessons_{slug(a.model or 'smollm2')}_{slug(device_name(a.device))}"
    path = write_json(name, dict(device=device_name(a.device), model=a.model, scale=a.scale, results=results))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
