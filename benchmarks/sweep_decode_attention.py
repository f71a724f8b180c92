"""Decode-attention launch configs on the ragged batches real workloads make (CUDA-graph replays, bf16): the
engine's config beside a grid of (BLOCK_N, warps, stages), at a preset's heads / head_dim.

    python benchmarks/sweep_decode_attention.py --shape qwen3-0.6b [--kv-cache-dtype fp8]
Cases: the nano workload's decode (256 sequences, contexts uniform 100-2,048), the prefill-heavy one's (128,
2,048-4,096), the long-context one's (256, 2,048-4,608), and 64 x 4,096. Prints GB/s of KV read against the copy
rate; writes benchmarks/results/sweep_decode_<device>_<shape>[_fp8].json. With an fp8 cache the grid also runs each
config with the products in fp16 (`f16_dot`: the codes converted to fp16, not bf16).
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import benchmarks.bench_kernels as bk  # noqa: E402
from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine.kernels.decode_attention import _decode_config, decode_num_splits, paged_attention_decode  # noqa: E402
from engine.kernels.paged_attention_ref import paged_attention_decode_ref  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402

CASES = {"nano (256 x 100-2048)": (256, 100, 2048), "prefill-heavy (128 x 2048-4096)": (128, 2048, 4096),
         "longctx (256 x 2048-4608)": (256, 2048, 4608), "uniform (64 x 4096)": (64, 4096, 4096)}
GRID = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--grid", default="", help="BLOCK_N/warps/stages[/f16],... instead of the full grid")
    args = ap.parse_args()
    pc = preset_config(args.shape)
    bk.H, bk.HK, bk.D = pc["num_attention_heads"], pc["num_key_value_heads"], pc["head_dim"]
    smoke = bk.SMOKE
    fp8 = args.kv_cache_dtype == "fp8"
    grid = [(bn, w, s, f16) for bn, w, s in GRID for f16 in ((False, True) if fp8 else (False,))]
    if args.grid:
        grid = [(*map(int, g.split("/")[:3]), g.endswith("/f16")) for g in args.grid.split(",")]
    copy = bk.ceilings()["copy_GBps"]
    rows = []
    for case in args.cases.split(","):
        B, lo, hi = CASES[case]
        if smoke:
            B, lo, hi = 3, 20, 60
        rng = random.Random(0)
        lens = [rng.randint(lo, hi) for _ in range(B)]
        q, kc, vc, md = bk.make_batch([1] * B, lens)
        if fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        nbytes = 2 * sum(lens) * bk.HK * bk.D * kc.element_size()
        ref = paged_attention_decode_ref(q, kc, vc, md.block_tables, md.seq_lens, bk.D ** -0.5)
        hint = 4096 if not smoke else 64
        S_rule = decode_num_splits(B, bk.HK, hint, q.device)
        eng = _decode_config(bk.H // bk.HK, bk.D, q.dtype, q.device, S_rule, kc.dtype)
        trials = [("engine", None, S_rule)] + [
            (f"{bn}/{w}/{s}" + ("/f16" if f16 else ""), dict(BLOCK_N=bn, num_warps=w, num_stages=s, f16_dot=f16), S)
            for bn, w, s, f16 in grid for S in sorted({1, S_rule})]
        if smoke:
            trials = trials[:3]
        for name, cfg, S in trials:
            try:
                ms, out = bk.graph_replay_ms(lambda: paged_attention_decode(  # noqa: B023
                    q, kc, vc, md.block_tables, md.seq_lens, bk.D ** -0.5, hint, num_splits=S, config=cfg))
                err, us = bk.rel_err(out, ref), ms * 1e3
            except Exception as e:  # a config over the shared-memory limit does not compile
                err, us = str(e)[:60], float("nan")
            rows.append(dict(case=case, config=name if cfg else f"engine {tuple(eng.values())[:3]}", splits=S, us=us,
                             GBps=nbytes / us / 1e3 if us == us else None,
                             pct_copy=100 * nbytes / us / 1e3 / copy if us == us else None, err=err))
        del q, kc, vc, md
    best = {}
    for r in rows:
        if r["us"] == r["us"] and (r["case"] not in best or r["us"] < best[r["case"]]["us"]):
            best[r["case"]] = r
    shown = [r for r in rows if r["config"].startswith("engine")] + list(best.values())
    print(f"device {device_name()}; {args.shape}: H {bk.H} / Hk {bk.HK}, D {bk.D}, {args.kv_cache_dtype} KV; "
          f"copy {copy:,.0f} GB/s")
    print_table(shown, ["case", "config", "splits", "us", "GBps", "pct_copy", "err"])
    top = sorted((r for r in rows if r["us"] == r["us"]), key=lambda r: (r["case"], r["us"]))
    for case in dict.fromkeys(r["case"] for r in top):
        print(case, [(r["config"], r["splits"], round(r["us"], 1)) for r in top if r["case"] == case][:6])
    write_json(f"sweep_decode_{slug(device_name())}_{args.shape}" + ("_fp8" if fp8 else ""),
               dict(device=device_name(), shape=args.shape, kv_cache_dtype=args.kv_cache_dtype, copy_GBps=copy,
                    rows=rows))


if __name__ == "__main__":
    main()
