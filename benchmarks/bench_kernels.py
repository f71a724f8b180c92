"""GPU benchmark: every Triton kernel vs its torch reference, against ceilings measured in the same run.

Ceilings: device-to-device copy bandwidth (bytes read + written) and a bf16 8192^3 matmul.
Shapes: Llama-3.2-1B attention (32 q heads, 8 kv heads, head_dim 64; --shape takes another preset's), hidden 2048,
intermediate 8192, bf16.
Usage: python benchmarks/bench_kernels.py [--sweep] [--shape llama-3.1-8b] [--tp 2] [--sections prefill] [--kv-cache-dtype fp8]
(prints a table last; writes benchmarks/results/kernels_<device>[_<shape>][_fp8].json). With an fp8 cache the
attention rows read e4m3 codes, and the prefill rows also time the products in bf16 instead of fp16.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import write_json  # noqa: E402
from engine.kernels import torch_ops  # noqa: E402
from engine.kernels import triton_ops as tk  # noqa: E402
from engine.kernels.metadata import AttentionMetadata  # noqa: E402
from engine.kernels.decode_attention import decode_num_splits  # noqa: E402
from engine.models.presets import preset_config  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMOKE = DEV.type == "cpu"                                    # interpreter dry run of the script itself: tiny sizes
BF16 = torch.float16 if SMOKE else torch.bfloat16
H, HK, D, BS = 32, 8, 64, 16
SIZES = dict(rows=16384, silu=(8192, 8192), decode=((64, 4096), (1, 4096), (4, 4096), (16, 4096), (32, 4096), (128, 4096), (256, 1024),
                                                  (128, (100, 2048))),
             prefill=4096,
             mixed_decodes=63,
             turn=(240, 2140, 256))
if SMOKE:
    SIZES = dict(rows=8, silu=(4, 64), decode=((3, 100), (3, (20, 60))), prefill=40, mixed_decodes=2, turn=(8, 40, 7))
ROWS: list[dict] = []


def bench(fn, warmup=25, rep=100) -> float:
    """Median milliseconds over CUDA-event-timed repeats."""
    if SMOKE:                                                # do_bench does not run in the interpreter
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_replay_ms(fn):
    """Capture fn once (after a warm-up on a side stream) and time its replays; returns (ms, output)."""
    if SMOKE:
        return bench(fn), fn()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    return bench(g.replay), out


def rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float("nan") if not torch.isfinite(out).all() else ((out - ref).norm() / ref.norm()).item()


def ceilings() -> dict:
    n = 1 << (12 if SMOKE else 29)                           # 1 GiB of bf16
    src = torch.randn(n, device=DEV, dtype=BF16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 2 / ms / 1e6
    del src, dst
    m = 256 if SMOKE else 8192
    a = torch.randn(m, m, device=DEV, dtype=BF16)
    b = torch.randn(m, m, device=DEV, dtype=BF16)
    ms = bench(lambda: a @ b)
    mm_tflops = 2 * m ** 3 / ms / 1e9
    return dict(copy_GBps=copy_gbs, bf16_matmul_TFLOPs=mm_tflops)


def row(name, shape, tri_ms, ref_ms, nbytes=0, flops=0, err=None, ceil=None, bound="mem", ref_name="torch", **extra):
    r = dict(kernel=name, shape=shape, triton_us=tri_ms * 1e3, ref_us=ref_ms * 1e3 if ref_ms else None,
             ref=ref_name, speedup=(ref_ms / tri_ms) if ref_ms else None,
             GBps=nbytes / tri_ms / 1e6 if nbytes else None, TFLOPs=flops / tri_ms / 1e9 if flops else None,
             rel_err=err, **extra)
    if ceil:
        r["pct_of_ceiling"] = 100 * (r["GBps"] / ceil["copy_GBps"] if bound == "mem" else r["TFLOPs"] / ceil["bf16_matmul_TFLOPs"])
        r["bound"] = "copy BW" if bound == "mem" else "bf16 matmul"
    ROWS.append(r)
    print(f"  {name:28s} {shape:34s} triton {r['triton_us']:9.1f} us  ref {r['ref_us'] or 0:9.1f} us  "
          f"{(r['GBps'] or 0):7.0f} GB/s {(r['TFLOPs'] or 0):6.1f} TF/s  {r.get('pct_of_ceiling', 0):5.1f}%  err {err}",
          flush=True)
    return r


# ---------------------------------------------------------------- elementwise kernels

def bench_elementwise(ceil):
    T, N = SIZES["rows"], 2048
    x, r = torch.randn(T, N, device=DEV, dtype=BF16), torch.randn(T, N, device=DEV, dtype=BF16)
    w = torch.randn(N, device=DEV, dtype=BF16)
    err = rel_err(tk.rms_norm(x, w, 1e-5, r)[0], torch_ops.rms_norm(x.float(), w.float(), 1e-5, r.float())[0])
    row("add+rms_norm", f"T={T} hidden={N}", bench(lambda: tk.rms_norm(x, w, 1e-5, r)),
        bench(lambda: torch_ops.rms_norm(x, w, 1e-5, r)), nbytes=4 * T * N * 2 + N * 2, err=err, ceil=ceil)
    row("rms_norm", f"T={T} hidden={N}", bench(lambda: tk.rms_norm(x, w, 1e-5)),
        bench(lambda: torch_ops.rms_norm(x, w, 1e-5)), nbytes=2 * T * N * 2 + N * 2, ceil=ceil)

    T, I = SIZES["silu"]
    x = torch.randn(T, 2 * I, device=DEV, dtype=BF16)
    err = rel_err(tk.silu_and_mul(x), torch_ops.silu_and_mul(x.float()))
    row("silu_and_mul", f"T={T} I={I}", bench(lambda: tk.silu_and_mul(x)),
        bench(lambda: torch_ops.silu_and_mul(x)), nbytes=3 * T * I * 2, err=err, ceil=ceil)

    T = SIZES["rows"]
    qkv = torch.randn(T, (H + 2 * HK) * D, device=DEV, dtype=BF16)
    q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + HK) * D].view(T, HK, D)
    v = qkv[:, (H + HK) * D:].view(T, HK, D)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    ang = torch.rand(8192, D // 2, device=DEV) * 6.28    # a real rotation: repeats keep |q| bounded
    cs = torch.cat((ang.cos(), ang.sin()), -1)
    q2, k2 = q.float(), k.float()
    tk.apply_rope(q, k, pos, cs)
    torch_ops.apply_rope(q2, k2, pos, cs)
    err = rel_err(q, q2)
    row("apply_rope (qkv views)", f"T={T} H={H} Hk={HK} D={D}", bench(lambda: tk.apply_rope(q, k, pos, cs)),
        bench(lambda: torch_ops.apply_rope(q, k, pos, cs)), nbytes=2 * T * (H + HK) * D * 2 + T * D * 4,
        err=err, ceil=ceil)

    T = SIZES["rows"] * 4
    qkv = torch.randn(T, (H + 2 * HK) * D, device=DEV, dtype=BF16)
    k, v = qkv[:, H * D:(H + HK) * D].view(T, HK, D), qkv[:, (H + HK) * D:].view(T, HK, D)
    nblocks = T // BS + 16
    kc = torch.randn(nblocks, BS, HK, D, device=DEV, dtype=BF16)
    vc = torch.randn_like(kc)
    slots = torch.randperm(nblocks * BS, device=DEV)[:T]
    kc2, vc2 = kc.clone(), vc.clone()
    tk.store_kvcache(k, v, kc, vc, slots)
    torch_ops.store_kvcache(k, v, kc2, vc2, slots)
    err = 0.0 if torch.equal(kc, kc2) and torch.equal(vc, vc2) else float("nan")
    row("store_kvcache (qkv views)", f"T={T} Hk={HK} D={D} bs={BS}", bench(lambda: tk.store_kvcache(k, v, kc, vc, slots)),
        bench(lambda: torch_ops.store_kvcache(k, v, kc, vc, slots)), nbytes=4 * T * HK * D * 2, err=err, ceil=ceil)


# ---------------------------------------------------------------- attention

def make_batch(q_lens, seq_lens, dtype=BF16):
    B = len(q_lens)
    need = [(s + BS - 1) // BS for s in seq_lens]
    nblocks = 1 + sum(need)
    kc = torch.randn(nblocks, BS, HK, D, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    perm = (torch.randperm(nblocks - 1, device=DEV) + 1).int()   # fragmented, like a long-running pool
    bt = torch.zeros(B, max(need), dtype=torch.int32, device=DEV)
    c = 0
    for i, n in enumerate(need):
        bt[i, :n] = perm[c:c + n]
        c += n
    cu = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    T = sum(q_lens)
    md = AttentionMetadata(
        positions=torch.zeros(T, dtype=torch.long, device=DEV), slot_mapping=torch.zeros(T, dtype=torch.long, device=DEV),
        cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=bt,
        logits_indices=cu[1:].long() - 1, q_lens=list(q_lens), seq_lens_cpu=list(seq_lens),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), block_size=BS)
    q = torch.randn(T, H, D, device=DEV, dtype=dtype)
    return q, kc, vc, md


def contiguous_kv(kc, vc, md):
    """[B, Hk, S, D] copies for torch SDPA on unpaged memory (a comparison point, not the contract)."""
    L = md.max_seqlen_k
    nb = (L + BS - 1) // BS
    bt = md.block_tables[:, :nb].long()
    k = kc[bt].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    v = vc[bt].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()
    return k, v


def bench_decode(ceil, sweep):
    scale = D ** -0.5
    for B, ctx in SIZES["decode"]:
        # ctx: every sequence's length, or (lo, hi): lengths drawn uniformly, as a ragged serving batch's
        lens = [ctx] * B if isinstance(ctx, int) else [random.Random(B).randint(*ctx) for _ in range(B)]
        L = max(lens)
        q, kc, vc, md = make_batch([1] * B, lens)
        nbytes = 2 * sum(lens) * HK * D * 2 + 2 * B * H * D * 2
        flops = 4 * H * D * sum(lens)
        tri = lambda: tk.paged_attention(q, kc, vc, md, scale)  # noqa: E731
        ref_out = torch_ops.paged_attention(q, kc, vc, md, scale)
        err = rel_err(tri(), ref_out)
        ref_ms = bench(lambda: torch_ops.paged_attention(q, kc, vc, md, scale), rep=50) if B <= 64 else None
        S = decode_num_splits(B, HK, L, DEV)
        main = row("paged_decode", f"B={B} ctx={ctx if isinstance(ctx, int) else '%d-%d' % ctx} H={H}/{HK} D={D}",
                   bench(tri), ref_ms, nbytes=nbytes,
                   flops=flops, err=err, ceil=ceil, splits=S)
        k, v = contiguous_kv(kc, vc, md)
        sd = lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)  # noqa: E731
        main["sdpa_contiguous_us"] = bench(sd) * 1e3
        del k, v
        # CUDA-graph replay of the decode call (static inputs, hint fixed): what the engine's decode steps see
        ms, out_g = graph_replay_ms(lambda: tk.paged_attention_decode(q, kc, vc, md.block_tables, md.seq_lens, scale, L))
        main["graph_replay_us"] = ms * 1e3
        main["graph_GBps"] = nbytes / ms / 1e6
        main["graph_pct_of_copy"] = 100 * main["graph_GBps"] / ceil["copy_GBps"]
        main["graph_rel_err"] = rel_err(out_g, ref_out)
        if sweep:                                            # graph replays: no launch overhead in the numbers
            res = []
            for bn, warps, stages in ((64, 2, 3), (64, 4, 3), (32, 2, 3), (128, 4, 3)):
                for s in (1, 2, 4, 8, 16, 32):
                    if B * HK * s > 8 * 1024 or (s > 1 and L // s < 128):
                        continue
                    cfg = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
                    try:
                        ms, o = graph_replay_ms(lambda: tk.paged_attention_decode(  # noqa: B023
                            q, kc, vc, md.block_tables, md.seq_lens, scale, L, num_splits=s, config=cfg))
                        e, us = rel_err(o, ref_out), ms * 1e3
                    except Exception as ex:  # a config that does not compile (resources) is skipped
                        e, us = str(ex)[:80], float("nan")
                    res.append(dict(cfg=cfg, splits=s, us=us, GBps=nbytes / us / 1e3, err=e))
            res.sort(key=lambda r: r["us"] if r["us"] == r["us"] else 1e18)
            main["sweep"] = res
            print("    best decode configs (graph):", [(tuple(r["cfg"].values()), r["splits"], round(r["us"], 1))
                                                    for r in res[:4]], flush=True)
        del q, kc, vc, md


def bench_prefill(ceil, sweep, fp8=False):
    scale = D ** -0.5
    L, nd = SIZES["prefill"], SIZES["mixed_decodes"]
    sweeps = {"prefill": ((128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3),
                          (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 3), (64, 128, 4, 3)),
              "verify": ((16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (16, 32, 2, 3), (128, 64, 8, 3))}
    sweeps["fresh"] = sweeps["chunk"] = sweeps["prefill"]    # unequal prompts, chunks: the same tilings
    odd = [L * 3 // 8 + 3, L // 2 + 5, L * 3 // 4 + 1]
    for q_lens, seq_lens, label in (([L] * 4, [L] * 4, f"prefill 4x{L}"),
                                    (odd, odd, f"fresh {'+'.join(map(str, odd))}"),
                                    ([L // 2] * 2, [L] * 2, f"chunk 2x({L // 2} of {L})"),
                                    ([L // 4] + [1] * nd, [L] * (nd + 1), f"mixed {L // 4}-chunk+{nd} dec"),
                                    ([4] * (nd + 1), [L] * (nd + 1), f"verify {nd + 1}x(4 of {L})")):
        q, kc, vc, md = make_batch(q_lens, seq_lens)
        if fp8:
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        flops = sum(4 * H * D * (ql * (sl - ql) + ql * (ql + 1) // 2) for ql, sl in zip(q_lens, seq_lens))
        nbytes = sum(2 * sl * HK * D * kc.element_size() for sl in seq_lens) + 2 * q.numel() * 2
        tri = lambda: tk.paged_attention(q, kc, vc, md, scale)  # noqa: E731
        ref_out = torch_ops.paged_attention(q, kc, vc, md, scale)
        err = rel_err(tri(), ref_out)
        main = row("paged_prefill", f"{label} H={H}/{HK} D={D}", bench(tri),
                   bench(lambda: torch_ops.paged_attention(q, kc, vc, md, scale), rep=50),
                   nbytes=nbytes, flops=flops, err=err, ceil=ceil, bound="flop")
        if fp8 and q.dtype == torch.bfloat16:                # the codes converted to bf16 for the products
            main["bf16_products_us"] = bench(
                lambda: tk.paged_attention(q, kc, vc, md, scale, config=dict(f16_dot=False))) * 1e3
        if label.startswith("prefill") and not fp8:          # flash SDPA on contiguous, unpaged q/k/v
            k, v = contiguous_kv(kc, vc, md)
            qq = q.view(len(q_lens), -1, H, D).transpose(1, 2)
            main["sdpa_flash_contiguous_us"] = bench(
                lambda: F.scaled_dot_product_attention(qq, k, v, is_causal=True, scale=scale, enable_gqa=True)) * 1e3
            del k, v
        if label.startswith("mixed"):                        # decodes inside the prefill kernel instead
            main["decodes_in_prefill_kernel_us"] = bench(
                lambda: tk.paged_attention(q, kc, vc, md, scale, config=dict(decodes_apart=False))) * 1e3
        kind = label.split()[0]
        if sweep and kind in sweeps:
            res = []
            for bm, bn, warps, stages in sweeps[kind]:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
                try:
                    f = lambda: tk.paged_attention(q, kc, vc, md, scale, config=cfg)  # noqa: E731
                    e = rel_err(f(), ref_out)
                    us = bench(f, warmup=10, rep=40) * 1e3
                except Exception as ex:
                    e, us = str(ex)[:80], float("nan")
                res.append(dict(cfg=cfg, us=us, TFLOPs=flops / us / 1e6, err=e))
            res.sort(key=lambda r: r["us"] if r["us"] == r["us"] else 1e18)
            main["sweep"] = res
            print("    best prefill configs:", [(r["cfg"], round(r["us"], 1), round(r["TFLOPs"], 1)) for r in res[:5]],
                  flush=True)
        del q, kc, vc, md
    bench_turn_in_mixed_graph(ceil)


def bench_turn_in_mixed_graph(ceil):
    """A chat turn's prefill (a short chunk over a long cached prefix) laid out as a mixed CUDA graph lays out a
    step: every sequence slot after the step's own is empty (cu_seqlens_q = T, length 0) and still owns a program.
    Graph replays; `one_sequence_us` is the same chunk launched alone, so the difference is the empty slots' cost."""
    scale = D ** -0.5
    q_len, seq_len, empty = SIZES["turn"]
    q, kc, vc, md = make_batch([q_len], [seq_len])
    T = q.shape[0]
    slots = dataclasses.replace(
        md, cu_seqlens_q=torch.cat([md.cu_seqlens_q, torch.full((empty,), T, dtype=torch.int32, device=DEV)]),
        seq_lens=torch.cat([md.seq_lens, torch.zeros(empty, dtype=torch.int32, device=DEV)]),
        block_tables=torch.cat([md.block_tables, torch.zeros(empty, md.block_tables.shape[1], dtype=torch.int32,
                                                             device=DEV)]),
        q_lens=md.q_lens + [0] * empty, seq_lens_cpu=md.seq_lens_cpu + [0] * empty)
    ref_out = torch_ops.paged_attention(q, kc, vc, md, scale)
    ms, out = graph_replay_ms(lambda: tk.paged_attention(q, kc, vc, slots, scale))
    alone_ms, _ = graph_replay_ms(lambda: tk.paged_attention(q, kc, vc, md, scale))
    flops = 4 * H * D * (q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2)
    main = row("paged_prefill", f"turn {q_len} of {seq_len} +{empty} empty slots H={H}/{HK} D={D}", ms, None,
               flops=flops, err=rel_err(out, ref_out), ceil=ceil, bound="flop")
    main["one_sequence_us"] = alone_ms * 1e3


def _fmt(e) -> str:
    return "-" if e is None else f"{e:.1e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time a grid of attention launch configs")
    ap.add_argument("--shape", default="llama-3.2-1b", help="a preset whose attention heads / head_dim to use")
    ap.add_argument("--tp", type=int, default=1, help="the heads of one tensor-parallel rank's shard (H / tp, "
                    "Hk / tp, at least one KV head)")
    ap.add_argument("--sections", default="elementwise,decode,prefill")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: the prefill rows read "
                    "e4m3 codes")
    args = ap.parse_args()
    global H, HK, D
    pc = preset_config(args.shape)
    H, HK, D = pc["num_attention_heads"] // args.tp, max(1, pc["num_key_value_heads"] // args.tp), pc["head_dim"]
    t0 = time.time()
    name = "cpu-interpreter-smoke" if SMOKE else torch.cuda.get_device_name(DEV)
    print(f"device {name}, torch {torch.__version__}, triton {triton.__version__}; attention {H} q / {HK} kv heads, "
          f"head_dim {D} ({args.shape})", flush=True)
    torch.manual_seed(0)
    ceil = ceilings()
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    sections = args.sections.split(",")
    if "elementwise" in sections:
        bench_elementwise(ceil)
    if "decode" in sections:
        bench_decode(ceil, args.sweep)
    if "prefill" in sections:
        bench_prefill(ceil, args.sweep, fp8=args.kv_cache_dtype == "fp8")

    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, ceilings=ceil, rows=ROWS,
                  seconds=time.time() - t0)
    tag = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") + ("" if args.shape == "llama-3.2-1b" else f"_{args.shape}")
    tag += "" if args.kv_cache_dtype == "auto" else f"_{args.kv_cache_dtype}"
    tag += "" if args.tp == 1 else f"_tp{args.tp}"
    tag += "" if args.sections == "elementwise,decode,prefill" else "_" + args.sections.replace(",", "-")
    path = f"/tmp/kernels_{tag}.json (not written)" if SMOKE else write_json(f"kernels_{tag}", result)
    print(f"\n{name}: copy {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'kernel':26s} {'shape':40s} {'triton us':>10s} {'torch us':>10s} {'x':>6s} {'GB/s':>7s} {'TF/s':>7s} {'%ceil':>6s}  err")
    for r in ROWS:
        print(f"{r['kernel']:26s} {r['shape']:40s} {r['triton_us']:10.1f} {r['ref_us'] or 0:10.1f} "
              f"{r['speedup'] or 0:6.1f} {r['GBps'] or 0:7.0f} {r['TFLOPs'] or 0:7.1f} {r.get('pct_of_ceiling', 0):5.1f}%  "
              f"{_fmt(r['rel_err'])}"
              + (f"  graph {r['graph_replay_us']:.1f}us {r['graph_pct_of_copy']:.0f}% S={r['splits']}"
                 if "graph_replay_us" in r else "")
              + (f"  decodes-in-prefill {r['decodes_in_prefill_kernel_us']:.1f}us"
                 if "decodes_in_prefill_kernel_us" in r else "")
              + (f"  bf16 products {r['bf16_products_us']:.1f}us" if "bf16_products_us" in r else "")
              + (f"  one sequence {r['one_sequence_us']:.1f}us" if "one_sequence_us" in r else ""))
    print(f"total {time.time() - t0:.0f} s; json: {path}")


if __name__ == "__main__":
    main()
