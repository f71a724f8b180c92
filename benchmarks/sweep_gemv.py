"""GPU: the small-batch fused linear (engine/kernels/gemv.py) on a preset's four projections (Llama-3.2-1B by default) at batch 1,
swept over launch configs of both variants (tiled: BLOCK_N rows per program walking K, PRE prefetching the next
tile; persistent: a few programs per SM, whole-K rows, DEPTH tiles ahead), against the tiled rule (the previous
default), cuBLAS (F.linear) and the unfused kernels it replaces, as % of copy bandwidth.

Each timing is a CUDA-graph replay of calls that cycle through enough weight copies (>= 256 MB) that L2 never
holds the weight, as in a real decode step. Configs compile in parallel worker processes first.
Usage: python benchmarks/sweep_gemv.py [--quick] [--shape llama-3.1-8b[,llama-3.2-1b]] [--ms 1,2,4,8] [--tp 2]
       [--table-out winners.json]   (bench_gpu.py / profiler.py decode --gemv-table winners.json use them)
(table last; JSON to benchmarks/results/gemv_<device>_<shape>[_tp<N>].json)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.bench_kernels import bench, ceilings  # noqa: E402
from benchmarks.common import device_name, slug, write_json  # noqa: E402
from engine.kernels import triton_ops as tk  # noqa: E402
from engine.kernels.gemv import GEMV_CONFIGS, gemv_config  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402



def shapes_for(preset: str, tp: int = 1) -> dict[str, tuple]:
    """name -> (N, K, prologue, residual): a preset's four decode-step linears, as one of tp ranks holds them
    (q/k/v and gate/up split by rows, o and down by columns)."""
    c = preset_config(preset)
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    H, Hk = c["num_attention_heads"] // tp, c["num_key_value_heads"] // tp
    return {"qkv": ((H + 2 * Hk) * d, h, "rms_norm", False), "o": (h, H * d, None, True),
            "gate_up": (2 * i // tp, h, "rms_norm", False), "down": (h, i // tp, "silu_mul", True)}


def configs(quick: bool, K: int = 4096):
    """Tiled ("tiled", BN, BK, warps, PRE) and persistent ("persistent", BN, warps, programs per SM, DEPTH)."""
    tiled = [("tiled", bn, bk, w, pre) for bn, bk, w, pre in
             itertools.product((2, 4, 8), (1024, 2048, 4096), (4, 8), (0, 1)) if 64 * w <= bn * bk <= 32768]
    kp = 1 << (K - 1).bit_length()
    pers = [("persistent", bn, w, per_sm, depth) for bn, w, per_sm, depth in
            itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 3), (1, 2)) if bn * kp <= 16384 and kp <= 16384]
    out = tiled + pers
    return out[::4] if quick else out


def make(spec, M, copies=1):
    N, K, pro, res = spec
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, 2 * K if pro == "silu_mul" else K, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).bfloat16() for _ in range(copies)]
    nw = (torch.rand(K, device="cuda", generator=g) + 0.5).bfloat16() if pro == "rms_norm" else None
    r = torch.randn(M, N, device="cuda", generator=g).bfloat16() if res else None
    return x, ws, nw, r


def call(spec, x, w, nw, r, cfg=None, variant="auto"):
    return tk.fused_linear(x, w, prologue=spec[2], norm_weight=nw, eps=1e-5, residual=r, config=cfg, variant=variant)


def unfused(spec, x, w, nw, r):
    pro = spec[2]
    if pro == "rms_norm":
        x = tk.rms_norm(x, nw, 1e-5)[0]
    elif pro == "silu_mul":
        x = tk.silu_and_mul(x)
    y = F.linear(x, w)
    return y if r is None else y + r


def qkv_configs():
    """(P rotation pairs per program, BLOCK_K, num_warps) of the q/k/v-RoPE-store kernel."""
    return [(P, bk, w) for P, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (1, 2, 4, 8))
            if 2 * P * bk <= 16384 and 64 * w <= 2 * P * bk]


def make_qkv(preset, copies=1, tp=1):
    c = preset_config(preset)
    h, d, H, Hk = c["hidden_size"], c["head_dim"], c["num_attention_heads"] // tp, c["num_key_value_heads"] // tp
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, h, device="cuda", generator=g).bfloat16()
    ws = [(torch.randn((H + 2 * Hk) * d, h, device="cuda", generator=g) / h ** 0.5).bfloat16() for _ in range(copies)]
    nw = (torch.rand(h, device="cuda", generator=g) + 0.5).bfloat16()
    cs = torch.randn(4096, d, device="cuda", generator=g)
    kc, vc = (torch.zeros(64, 16, Hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pos = torch.tensor([300], device="cuda")
    slots = torch.tensor([77], device="cuda")
    return dict(x=x, ws=ws, nw=nw, cs=cs, kc=kc, vc=vc, pos=pos, slots=slots, H=H, Hk=Hk)


def call_qkv(t, w, cfg):
    return tk.fused_qkv_rope_store(t["x"], w, None, t["nw"], 1e-5, t["H"], t["Hk"], t["pos"], t["cs"], t["kc"],
                                   t["vc"], t["slots"], config=cfg)


def _compile_qkv(job):
    preset, cfg, tp = job
    try:
        t = make_qkv(preset, tp=tp)
        call_qkv(t, t["ws"][0], cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def sweep_qkv(preset, bw, rep, pool, tp=1):
    """The q/k/v-RoPE-store kernel's configs at M = 1 -> (table key, best config, rows)."""
    cfgs = qkv_configs()
    errors = dict(zip(cfgs, pool.map(_compile_qkv, [(preset, c, tp) for c in cfgs])))
    t = make_qkv(preset, tp=tp)
    N, K = t["ws"][0].shape
    D = N // (t["H"] + 2 * t["Hk"])
    copies = max(2, -(-256 * 2 ** 20 // (N * K * 2)))
    t = make_qkv(preset, copies, tp)
    rows = []
    q_ref = call_qkv(t, t["ws"][0], None).float()
    for c in [None] + [c for c in cfgs if errors[c] is None]:
        q = call_qkv(t, t["ws"][0], c).float()
        if not ((q - q_ref).norm() / q_ref.norm()).item() < 0.02:
            print(f"qkv_rope {c}: wrong result", flush=True)
            continue
        us = graph_us(lambda w, c=c: call_qkv(t, w, c), t["ws"], rep)
        rows.append(dict(shape="qkv_rope", cfg=c, us=us, pct_copy=100 * N * K * 2 / us / 1e3 / bw))
    rule = rows[0]
    rows = sorted(rows[1:], key=lambda d: d["us"])
    print(f"qkv_rope {preset} ({N}x{K}, D {D}): rule {rule['us']:.1f} us ({rule['pct_copy']:.0f}%), best "
          f"{rows[0]['cfg']} {rows[0]['us']:.1f} us ({rows[0]['pct_copy']:.0f}%); next {rows[1:4]}", flush=True)
    return f"qkv:{N},{K},{D}", rows[0]["cfg"], [rule] + rows[:12]


def _compile(job):
    spec, M, cfg = job
    x, ws, nw, r = make(spec, M)
    try:
        call(spec, x, ws[0], nw, r, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:80]}"


def graph_us(fn, ws, rep: int = 40) -> float:
    """Per-call microseconds of fn(w) over a graph that cycles twice through the weight copies."""
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for w in ws[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(2):
            for w in ws:
                fn(w)
    return bench(g.replay, warmup=5, rep=rep) * 1e3 / (2 * len(ws))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shape", default="llama-3.2-1b", help="presets whose linears to sweep (comma-separated)")
    ap.add_argument("--ms", default="1,2,4,8", help="batch sizes of the comparison rows")
    ap.add_argument("--table-out", default="", help="write the winners as {\"N,K\": config} (--gemv-table of bench_gpu.py)")
    ap.add_argument("--rep", type=int, default=40, help="ms of timed replays per config")
    ap.add_argument("--qkv-rope", action="store_true", help="also sweep the q/k/v-RoPE-store kernel (M = 1)")
    ap.add_argument("--tp", type=int, default=1, help="the shapes one of this many tensor-parallel ranks holds")
    args = ap.parse_args()
    shapes = {}
    for preset in args.shape.split(","):
        for name, spec in shapes_for(preset, args.tp).items():
            if spec not in shapes.values():
                shapes[name if len(args.shape.split(",")) == 1 else f"{preset}:{name}"] = spec
    t0 = time.time()
    dev = device_name()
    ceil = ceilings()
    bw = ceil["copy_GBps"]
    jobs = [(spec, 1, c) for spec in shapes.values() for c in configs(args.quick, spec[1])]
    ctx = torch.multiprocessing.get_context("spawn")
    qkv = []
    with ProcessPoolExecutor(max_workers=min(14, os.cpu_count() or 2), mp_context=ctx) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs)))
        if args.qkv_rope:
            qkv = [sweep_qkv(preset, bw, args.rep, pool, args.tp) for preset in args.shape.split(",")]
    print(f"compiled {len(jobs)} configs in {time.time() - t0:.0f} s ({sum(e is not None for e in errors.values())} failed)",
          flush=True)
    rows, best = [], {}
    for name, spec in shapes.items():
        N, K, pro, res = spec
        wbytes = N * K * 2
        copies = max(2, -(-256 * 2 ** 20 // wbytes))
        x, ws, nw, r = make(spec, 1, copies)
        ref = unfused(spec, x.float(), ws[0].float(), None if nw is None else nw.float(), None if r is None else r.float())
        sweep = []
        for c in configs(args.quick, K):
            if errors.get((spec, 1, c)):
                continue
            try:
                err = ((call(spec, x, ws[0], nw, r, c).float() - ref).norm() / ref.norm()).item()
                if not err < 0.02:                          # a wrong result never wins
                    print(f"{name} {c}: rel_err {err:.3g}", flush=True)
                    continue
                us = graph_us(lambda w, c=c: call(spec, x, w, nw, r, c), ws, args.rep)
            except Exception as e:
                print(f"{name} {c}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            sweep.append(dict(shape=name, M=1, cfg=c, us=us, pct_copy=100 * wbytes / us / 1e3 / bw, rel_err=err))
        sweep.sort(key=lambda d: d["us"])
        best[name] = sweep[0]["cfg"]
        print(f"{name}: best {sweep[:3]}", flush=True)
        for M in map(int, args.ms.split(",")):
            x, ws, nw, r = make(spec, M, copies)
            xk = x[:, :K].contiguous()                      # cuBLAS alone: the plain [M, K] input
            row = dict(shape=name, N=N, K=K, M=M, prologue=pro, residual=res, weight_MB=wbytes / 1e6)
            for label, fn in (("best", lambda w: call(spec, x, w, nw, r, best[name])),
                              ("heuristic", lambda w: call(spec, x, w, nw, r, variant="tiled")),
                              ("table", lambda w: call(spec, x, w, nw, r)),
                              ("cublas", lambda w: F.linear(xk, w)),
                              ("unfused", lambda w: unfused(spec, x, w, nw, r))):
                us = graph_us(fn, ws)
                row[f"{label}_us"] = us
                row[f"{label}_pct"] = 100 * wbytes / us / 1e3 / bw
            row["best_cfg"] = best[name]
            row["heuristic_cfg"] = gemv_config(M, N, K)
            row["table_cfg"] = GEMV_CONFIGS.get((N, K))
            rows.append(row)
            print(row, flush=True)
        rows.append(dict(shape=name, sweep=sweep[:12]))
        del x, ws
        torch.cuda.empty_cache()
    out = dict(device=dev, ceilings=ceil, best=best, rows=rows, seconds=time.time() - t0)
    table = {f"{spec[0]},{spec[1]}": list(best[name]) for name, spec in shapes.items()}
    for key, cfg, qrows in qkv:
        table[key] = list(cfg)
        out["rows"].append(dict(shape=key, sweep=qrows))
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump(table, f)
    print("GEMV_CONFIGS = {" + ", ".join(f"({k}): {tuple(v)!r}" for k, v in table.items() if ":" not in k) + "}")
    print("QKV_ROPE_CONFIGS = {" + ", ".join(f"({k[4:]}): {tuple(v)!r}" for k, v in table.items() if ":" in k) + "}")
    write_json(f"gemv_{slug(dev)}_{args.shape.replace(',', '+')}" + (f"_tp{args.tp}" if args.tp > 1 else ""), out)
    print(f"\n{dev}: copy {bw:.0f} GB/s; per call us (% of copy bandwidth), weights streamed from HBM")
    print(f"{'shape':8s} {'M':>2s} {'MB':>6s} {'fused best':>16s} {'tiled rule':>16s} {'table':>16s} {'cuBLAS':>16s} "
          f"{'unfused':>16s}  best cfg")
    for r in rows:
        if "M" in r:
            print(f"{r['shape']:8s} {r['M']:2d} {r['weight_MB']:6.1f} " + " ".join(
                f"{r[k + '_us']:8.1f} ({r[k + '_pct']:4.0f}%)" for k in ("best", "heuristic", "table", "cublas", "unfused"))
                + f"  {r['best_cfg']}")
    print(f"best: {json.dumps(best)}; {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
