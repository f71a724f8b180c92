"""Where does a batch-1 decode step go? A dummy preset's shape (Llama-3.2-1B by default), bf16, one
128-token prompt: profiles one (multi-)step of the decode with torch.profiler and prints its kernels per
decode iteration, against the HBM floor (weight + KV bytes / measured copy bandwidth).

    python benchmarks/profile_decode.py [--shape llama-3.1-8b] [--steps 8] [--gemv 0] [--pdl 0]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import copy_bandwidth, model_bytes  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b", help="a dummy preset")
    ap.add_argument("--steps", type=int, default=8, help="num_scheduler_steps")
    ap.add_argument("--gemv", type=int, default=None, help="gemv_max_tokens (default: the engine's)")
    ap.add_argument("--pdl", type=int, default=1, help="enable_pdl (0: kernel times not stretched by early starts)")
    ap.add_argument("--gemv-table", default="", help="a sweep_gemv.py --table-out JSON merged into the tuned tables")
    args = ap.parse_args()
    if args.gemv_table:
        from benchmarks.common import load_gemv_table
        load_gemv_table(args.gemv_table)
    bw = copy_bandwidth()
    weights, kv = model_bytes(preset_config(args.shape))
    llm = LLM(f"dummy:{args.shape}", max_model_len=4096, max_num_seqs=8, num_scheduler_steps=args.steps,
              gemv_max_tokens=args.gemv, enable_pdl=bool(args.pdl))
    eng = llm.engine
    eng.add_request(list(range(1000, 1128)), SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
    for i in range(6):
        eng.step()
    eng.profile_step()
    eng.step()
    iters = args.steps
    floor_us = (weights + kv * 200) / bw * 1e6
    print(f"HBM floor per token {floor_us:.0f} us (copy {bw / 1e9:.0f} GB/s); per decode iteration below "
          f"(profiled step / {iters})")
    total = 0.0
    for r in eng.last_profile:
        if r["name"].startswith(("aten::", "cuda", "Activity", "ProfilerStep")) or not r["device_time_ms"]:
            continue
        us = r["device_time_ms"] * 1e3 / iters
        total += us
        print(f"{us:9.1f} us  x{r['count'] // iters:<4} {r['name'][:100]}")
    print(f"device total {total:.0f} us per iteration ({100 * floor_us / total:.0f}% of the floor)")


if __name__ == "__main__":
    main()
