"""Triton kernels vs plain-torch references (float64 where it matters).

CPU: runs under the Triton interpreter (conftest sets TRITON_INTERPRET=1) with small shapes, fp32/fp16.
GPU (TRITON_INTERPRET=0 and CUDA): the same tests at full sizes, bf16 too, plus CUDA-graph capture.
"""
import os

import pytest
import torch

from engine.kernels import ops, torch_ops
from engine.kernels import triton_ops as tk
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.paged_attention_ref import paged_attention_decode_ref, paged_attention_ref

GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
DEV = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if GPU else [])  # interpreter: bf16 dot is wrong
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
gpu_only = pytest.mark.skipif(not GPU, reason="needs CUDA with TRITON_INTERPRET=0")


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- elementwise kernels

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 77)] + ([(257, 4096), (33, 576)] if GPU else []))
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm(dtype, shape, with_residual):
    x, w = rand(*shape, dtype=dtype), rand(shape[1], dtype=dtype)
    r = rand(*shape, dtype=dtype) if with_residual else None
    out, res = tk.rms_norm(x, w, 1e-5, r)
    ref_out, _ = torch_ops.rms_norm(x.double(), w.double(), 1e-5, None if r is None else r.double())
    assert rel_err(out, ref_out) < TOL[dtype]
    if with_residual:
        assert torch.equal(res, x + r)
    else:
        assert res is x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 45)] + ([(300, 8192), (3, 1536)] if GPU else []))
def test_silu_and_mul(dtype, shape):
    x = rand(shape[0], 2 * shape[1], dtype=dtype)
    out = tk.silu_and_mul(x)
    assert out.shape == (shape[0], shape[1])
    assert rel_err(out, torch_ops.silu_and_mul(x.double())) < TOL[dtype]


def _qkv(T, H, Hk, D, dtype):
    """q [T, H, D], k/v [T, Hk, D]: non-contiguous views of one fused projection output."""
    qkv = rand(T, (H + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)
    v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hk,D", [(1, 9, 3, 32), (37, 5, 3, 24)] + ([(257, 16, 8, 128), (4099, 32, 8, 128)] if GPU else []))
def test_head_rms_norm_in_place(dtype, T, H, Hk, D):
    """Qwen3's q/k norm on the strided views of a qkv output, in place: q and k match the reference, v is untouched."""
    q, k, v = _qkv(T, H, Hk, D, dtype)
    wq, wk = rand(D, dtype=dtype), rand(D, dtype=dtype)
    q_ref = torch_ops.rms_norm(q.double(), wq.double(), 1e-6)[0]
    k_ref = torch_ops.rms_norm(k.double(), wk.double(), 1e-6)[0]
    v_before = v.clone()
    assert tk.head_rms_norm_(q, wq, 1e-6) is q and tk.head_rms_norm_(k, wk, 1e-6) is k
    assert rel_err(q, q_ref) < TOL[dtype] and rel_err(k, k_ref) < TOL[dtype]
    assert torch.equal(v, v_before)
    q2, _, _ = _qkv(T, H, Hk, D, dtype)                     # the torch backend's in-place op: same contract
    q2_ref = torch_ops.rms_norm(q2, wq, 1e-6)[0]
    torch_ops.head_rms_norm_(q2, wq, 1e-6)
    assert torch.equal(q2, q2_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hk,D", [(1, 9, 3, 32), (6, 9, 3, 64)] + ([(257, 32, 8, 64), (31, 12, 4, 128)] if GPU else []))
def test_apply_rope(dtype, T, H, Hk, D):
    q, k, _ = _qkv(T, H, Hk, D, dtype)
    positions = torch.randint(0, 500, (T,), device=DEV)
    cos_sin = rand(512, D)                                   # fp32 table, as a model would keep it
    q_ref, k_ref = q.double(), k.double()
    torch_ops.apply_rope(q_ref, k_ref, positions, cos_sin.double())
    tk.apply_rope(q, k, positions, cos_sin)
    assert (T == 1 or q.stride(0) == (H + 2 * Hk) * D) and rel_err(q, q_ref) < TOL[dtype] and rel_err(k, k_ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hk,D,bs", [(1, 3, 32, 4), (9, 3, 64, 16)] + ([(1000, 8, 128, 16)] if GPU else []))
def test_store_kvcache(dtype, T, Hk, D, bs):
    _, k, v = _qkv(T, 9, Hk, D, dtype)
    nblocks = (T + bs - 1) // bs + 3
    slots = torch.randperm(nblocks * bs, device=DEV)[:T]
    slots[T // 2] = -1                                       # a padding token: skipped
    kc, vc = rand(nblocks, bs, Hk, D, dtype=dtype), rand(nblocks, bs, Hk, D, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    tk.store_kvcache(k, v, kc, vc, slots)
    torch_ops.store_kvcache(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hk,D,bs", [(1, 9, 3, 32, 4), (7, 9, 3, 64, 16)] + ([(8, 32, 8, 64, 16)] if GPU else []))
def test_rope_and_store(dtype, T, H, Hk, D, bs):
    """One launch = apply_rope + store_kvcache: q rotated in place, rotated k and v in the caches."""
    q, k, v = _qkv(T, H, Hk, D, dtype)
    positions = torch.randint(0, 500, (T,), device=DEV)
    cos_sin = rand(512, D)
    nblocks = (T + bs - 1) // bs + 3
    slots = torch.randperm(nblocks * bs, device=DEV)[:T]
    slots[T // 2] = -1                                       # padding: nothing stored
    kc, vc = rand(nblocks, bs, Hk, D, dtype=dtype), rand(nblocks, bs, Hk, D, dtype=dtype)
    q_ref, k_ref, kc_ref, vc_ref = q.double(), k.double(), kc.double(), vc.double()
    torch_ops.rope_and_store(q_ref, k_ref, v.double(), positions, cos_sin.double(), kc_ref, vc_ref, slots)
    tk.rope_and_store(q, k, v, positions, cos_sin, kc, vc, slots)
    assert rel_err(q, q_ref) < TOL[dtype] and rel_err(kc, kc_ref) < TOL[dtype]
    assert torch.equal(vc.double(), vc_ref)
    untouched = torch.ones(nblocks * bs, dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kc.view(-1, Hk, D)[untouched].double(), kc_ref.view(-1, Hk, D)[untouched])


GEMV_SHAPES = [(1, 40, 72), (3, 24, 100), (8, 17, 64)] + ([(1, 3072, 2048), (4, 2048, 8192), (2, 16384, 2048)] if GPU else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", GEMV_SHAPES)
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("pdl", [False] + ([True] if GPU and torch.cuda.get_device_capability()[0] >= 9 else []))
def test_fused_linear(dtype, M, N, K, prologue, pdl):
    """Small-batch linear with its fusions vs the unfused torch composition (float64); odd M, N, K."""
    x = rand(M, 2 * K if prologue == "silu_mul" else K, dtype=dtype) * 2
    w = rand(N, K, dtype=dtype) / K ** 0.5
    nw = rand(K, dtype=dtype) + 1 if prologue == "rms_norm" else None
    bias = rand(N, dtype=dtype) if prologue is None else None
    residual = rand(M, N, dtype=dtype) if prologue != "rms_norm" else None
    out = tk.fused_linear(x, w, bias, prologue=prologue, norm_weight=nw, eps=1e-5, residual=residual, pdl=pdl)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = torch_ops.fused_linear(x.double(), w.double(), d(bias), prologue=prologue, norm_weight=d(nw), eps=1e-5,
                                 residual=d(residual))
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, ref) < 2 * TOL[dtype], rel_err(out, ref)


GEMV_CONFIGS = [("persistent", 2, 4, 1, 1), ("persistent", 4, 4, 2, 2), ("persistent", 1, 8, 3, 2),
                ("tiled", 4, 32, 4, 1), ("tiled", 2, 64, 2, 0), (4, 64, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (2, 19, 64)] + ([(1, 4096, 14336), (1, 28672, 4096)] if GPU else []))
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
@pytest.mark.parametrize("cfg", GEMV_CONFIGS + ["persistent", "tiled"])
def test_fused_linear_variants(dtype, M, N, K, prologue, cfg):
    """The persistent variant (prologue once per program, whole-K rows, DEPTH tiles prefetched, a grid of a few
    programs per SM looping over row tiles) and the tiled one with PRE, vs the torch reference; odd N, K."""
    if N * K > 1 << 20 and not isinstance(cfg, str):
        pytest.skip("full-size shapes: the variants' own configs only (benchmarks/sweep_gemv.py checks the rest)")
    x = rand(M, 2 * K if prologue == "silu_mul" else K, dtype=dtype) * 2
    w = rand(N, K, dtype=dtype) / K ** 0.5
    nw = rand(K, dtype=dtype) + 1 if prologue == "rms_norm" else None
    bias = rand(N, dtype=dtype) if prologue == "silu_mul" else None
    residual = rand(M, N, dtype=dtype) if prologue != "rms_norm" else None
    kw = dict(variant=cfg) if isinstance(cfg, str) else dict(config=cfg)
    out = tk.fused_linear(x, w, bias, prologue=prologue, norm_weight=nw, eps=1e-5, residual=residual, **kw)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = torch_ops.fused_linear(x.double(), w.double(), d(bias), prologue=prologue, norm_weight=d(nw), eps=1e-5,
                                 residual=d(residual))
    assert out.shape == (M, N) and out.dtype == dtype
    assert rel_err(out, ref) < 2 * TOL[dtype], rel_err(out, ref)


def test_gemv_resolve_config():
    """The tuned table is used at M = 1 on CUDA; "tiled" is the rule; persistent falls back to tiled where the
    activation row would not fit in registers; configs are well formed."""
    from engine.kernels.gemv import GEMV_CONFIGS, PERSISTENT_MAX_ELEMS, gemv_config, resolve_config
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_config(1, 4096, 4096, "tiled", cuda) == ("tiled", *gemv_config(1, 4096, 4096), 0)
    assert resolve_config(1, 4096, 4096, "auto", cpu) == ("tiled", *gemv_config(1, 4096, 4096), 0)
    assert resolve_config(1, 64, 2 * PERSISTENT_MAX_ELEMS, "persistent", cpu)[0] == "tiled"
    assert resolve_config(1, 64, 100, "persistent", cpu)[0] == "persistent"
    for (N, K), cfg in GEMV_CONFIGS.items():
        assert cfg[0] in ("tiled", "persistent") and len(cfg) == 5
        got = resolve_config(1, N, K, "auto", cuda)
        assert got[0] == cfg[0] and got[1] == cfg[1]
        assert resolve_config(1, N, K, "tiled", cuda)[0] == "tiled"
    with pytest.raises(AssertionError):
        resolve_config(1, 64, 64, "wide", cpu)


def test_persistent_linears_turn_auto_pdl_off():
    """enable_pdl=None: PDL stays on unless a decode linear takes the persistent GEMV (8B shape on CUDA)."""
    from engine.kernels.gemv import persistent_linears, resolve_config
    from engine.models.config import ModelConfig
    from engine.models.presets import preset_config
    cuda = torch.device("cuda")
    big = ModelConfig.from_hf(preset_config("llama-3.1-8b"))
    assert (4096, 4096) in persistent_linears(big, "auto", cuda) and not persistent_linears(big, "tiled", cuda)
    assert not persistent_linears(big, "auto", torch.device("cpu"))
    assert not persistent_linears(ModelConfig.from_hf(preset_config("llama-3.2-1b")), "auto", cuda)
    assert resolve_config(1, 2048, 8192, "auto", cuda)[0] == "persistent"   # 1B down: persistent, PDL kept on


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,H,Hk,D,K,bias", [(1, 9, 3, 32, 72, False), (3, 6, 2, 16, 40, True)]
                         + ([(1, 32, 8, 64, 2048, False), (2, 14, 2, 64, 896, True)] if GPU else []))
@pytest.mark.parametrize("config", [None, (1, 32, 2), (4, 64, 4)])
def test_fused_qkv_rope_store(dtype, M, H, Hk, D, K, bias, config):
    """q/k/v linear with RoPE and the KV store in its epilogue vs fused_linear + rope_and_store (float64);
    config: (rotation pairs per program, BLOCK_K, num_warps) as benchmarks/sweep_gemv.py --qkv-rope sweeps it."""
    pdl = GPU and torch.cuda.get_device_capability()[0] >= 9
    N, bs = (H + 2 * Hk) * D, 4
    x = rand(M, K, dtype=dtype) * 2
    w = rand(N, K, dtype=dtype) / K ** 0.5
    b = rand(N, dtype=dtype) if bias else None
    nw = rand(K, dtype=dtype) + 1
    positions = torch.randint(0, 500, (M,), device=DEV)
    cos_sin = rand(512, D)
    nblocks = M + 3
    slots = torch.randperm(nblocks * bs, device=DEV)[:M]
    if M > 1:
        slots[1] = -1                                        # padding row: nothing stored
    kc, vc = rand(nblocks, bs, Hk, D, dtype=dtype), rand(nblocks, bs, Hk, D, dtype=dtype)
    kc_ref, vc_ref = kc.double(), vc.double()
    q = tk.fused_qkv_rope_store(x, w, b, nw, 1e-5, H, Hk, positions, cos_sin, kc, vc, slots, pdl=pdl, config=config)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    q_ref = torch_ops.fused_qkv_rope_store(x.double(), w.double(), d(b), nw.double(), 1e-5, H, Hk, positions,
                                           cos_sin.double(), kc_ref, vc_ref, slots)
    assert q.shape == (M, H, D) and rel_err(q, q_ref) < 2 * TOL[dtype]
    assert rel_err(kc, kc_ref) < 2 * TOL[dtype] and rel_err(vc, vc_ref) < 2 * TOL[dtype]
    untouched = torch.ones(nblocks * bs, dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(kc.view(-1, Hk, D)[untouched].double(), kc_ref.view(-1, Hk, D)[untouched])
    assert torch.equal(vc.view(-1, Hk, D)[untouched].double(), vc_ref.view(-1, Hk, D)[untouched])


# ---------------------------------------------------------------- paged attention

def make_batch(q_lens, seq_lens, H, Hk, D, bs, dtype, spare_blocks=3):
    """Random caches whose unused slots (block 0, tails, spares) hold NaN; shuffled block tables."""
    B = len(q_lens)
    need = [(s + bs - 1) // bs for s in seq_lens]
    nblocks = 1 + sum(need) + spare_blocks                   # block 0 reserved: table padding
    kc = torch.full((nblocks, bs, Hk, D), float("nan"), device=DEV, dtype=dtype)
    vc = kc.clone()
    perm = (torch.randperm(nblocks - 1, device=DEV) + 1).int()
    bt = torch.zeros(B, max(need) + 2, dtype=torch.int32, device=DEV)
    c = 0
    for i, (n, s) in enumerate(zip(need, seq_lens)):
        bt[i, :n] = perm[c:c + n]
        c += n
        pos = torch.arange(s, device=DEV)
        blk = bt[i].long()[pos // bs]
        kc[blk, pos % bs] = rand(s, Hk, D, dtype=dtype)
        vc[blk, pos % bs] = rand(s, Hk, D, dtype=dtype)
    cu = torch.zeros(B + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    T = sum(q_lens)
    positions = torch.cat([torch.arange(s - q, s, device=DEV) for q, s in zip(q_lens, seq_lens)])
    md = AttentionMetadata(
        positions=positions, slot_mapping=torch.zeros(T, dtype=torch.long, device=DEV), cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=bt,
        logits_indices=cu[1:].long() - 1, q_lens=list(q_lens), seq_lens_cpu=list(seq_lens),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), block_size=bs)
    q = _qkv(T, H, Hk, D, dtype)[0]                          # strided like the model's q
    return q, kc, vc, md


def _check_attention(q, kc, vc, md, dtype, **kw):
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=dtype)     # poisoned: every row must be written
    tk.paged_attention(q, kc, vc, md, scale, out=out, **kw)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), md, scale)
    assert rel_err(out, ref) < TOL[dtype]


SMALL = dict(H=9, Hk=3, D=32)
ATTN_CASES = {                                               # name: (q_lens, seq_lens, block_size)
    "one_prefill": ([37], [37], 16),                         # block size does not divide the length
    "one_chunk": ([11], [50], 4),                            # chunk boundary: queries are the last 11 of 50
    "mixed": ([1, 23, 1, 9, 1], [70, 23, 5, 41, 1], 4),      # decodes (one of length 1) + prefill + chunk
    "mixed_bs1": ([3, 1], [20, 33], 1),
}
if GPU:
    ATTN_CASES.update({
        "big_prefill": ([1500], [1500], 16),
        "big_mixed": ([1] * 30 + [700, 257, 1] + [64] * 3, [2049] * 30 + [700, 1800, 9, 4000, 130, 64], 16),
    })


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention(dtype, case):
    q_lens, seq_lens, bs = ATTN_CASES[case]
    shapes = [SMALL] + ([dict(H=32, Hk=8, D=64), dict(H=12, Hk=4, D=128)] if GPU else [])
    for shp in shapes:
        _check_attention(*make_batch(q_lens, seq_lens, bs=bs, dtype=dtype, **shp), dtype)


@pytest.mark.parametrize("block_m,block_n,apart", [(16, 16, True), (64, 16, False)])
def test_paged_attention_tilings(block_m, block_n, apart):
    # small tiles: every causal diagonal offset modulo the key tile occurs (tile starts 2, 6, 10, 14, ...);
    # apart=False: the prefill kernel also serves the decode (one real query in its tile)
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1, decodes_apart=apart)
    batch = make_batch([30, 1, 5], [32, 17, 40], bs=4, dtype=torch.float32, **SMALL)
    _check_attention(*batch, torch.float32, config=cfg)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_mixed_split_decodes(dtype):
    # decodes of a mixed batch through the varlen split-K kernel, one of them a single key
    batch = make_batch([1, 12, 1, 1], [90, 12, 1, 47], bs=8, dtype=dtype, **SMALL)
    _check_attention(*batch, dtype, config=dict(decode_splits=4))


@pytest.mark.parametrize("H,Hk,D", [(4, 4, 16), (8, 1, 24)])  # no GQA; MQA with D not a power of two
def test_paged_attention_head_shapes(H, Hk, D):
    _check_attention(*make_batch([1, 6], [9, 21], H, Hk, D, 8, torch.float32), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("fused_merge", [False, True])
def test_paged_attention_decode_split(dtype, splits, fused_merge):
    # lengths 1 and short ones leave some splits empty; one is long enough for several tiles per split
    seq_lens = [1, 130, 7, 64] + ([4096, 3000, 33] * 10 if GPU else [])
    shp = dict(H=32, Hk=8, D=128) if GPU else SMALL
    q, kc, vc, md = make_batch([1] * len(seq_lens), seq_lens, bs=16, dtype=dtype, **shp)
    scale = q.shape[-1] ** -0.5
    for _ in range(2 if fused_merge else 1):                # the second launch reuses the (re-zeroed) counters
        out = tk.paged_attention_decode(q, kc, vc, md.block_tables, md.seq_lens, scale, md.max_seqlen_k,
                                        num_splits=splits, fused_merge=fused_merge)
        ref = paged_attention_decode_ref(q.double(), kc.double(), vc.double(), md.block_tables, md.seq_lens, scale)
        assert rel_err(out, ref) < TOL[dtype]
    if fused_merge:
        from engine.kernels.decode_attention import merge_counters
        assert int(merge_counters(DEV, 1).abs().sum()) == 0   # every launch leaves its counters zero


@pytest.mark.parametrize("fused_merge", [False, True])
def test_decode_padded_rows_are_zero(fused_merge):
    q, kc, vc, md = make_batch([1, 1], [5, 40], bs=8, dtype=torch.float32, **SMALL)
    lens = md.seq_lens.clone()
    lens[0] = 0                                              # a CUDA-graph padding row
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        tk.paged_attention_decode(q, kc, vc, md.block_tables, lens, 0.2, 64, num_splits=splits, out=out,
                                  fused_merge=fused_merge)
        assert torch.all(out[0] == 0) and torch.isfinite(out).all()


def test_decode_num_splits_static():
    for b in (1, 8, 64, 256):
        s = tk.decode_num_splits(b, 8, 8192, DEV)
        assert s >= 1 and s & (s - 1) == 0
    assert tk.decode_num_splits(1, 8, 100, DEV) == 1         # short contexts never split


def test_get_ops_triton():
    o = ops.get_ops("triton")
    assert o.paged_attention is tk.paged_attention and o.rms_norm is tk.rms_norm
    assert o.fused_linear is tk.fused_linear and o.rope_and_store is tk.rope_and_store
    assert o.fused_qkv_rope_store is tk.fused_qkv_rope_store


@gpu_only
@pytest.mark.parametrize("fused_merge", [False, True])
def test_decode_cuda_graph(fused_merge):
    """Capture once with static buffers, then replay with new lengths, tables and queries (fused_merge: the
    split counters must be zero again after every replay, and short contexts leave most splits idle)."""
    B, H, Hk, D, bs, max_len = 16, 32, 8, 64, 16, 4096
    width = max_len // bs
    _, kc, vc, _ = make_batch([1], [max_len * 4], H, Hk, D, bs, torch.bfloat16)   # a big enough pool
    kc = torch.randn_like(kc)
    vc = torch.randn_like(vc)
    q_s = torch.empty(B, H, D, device=DEV, dtype=torch.bfloat16)
    bt_s = torch.zeros(B, width, dtype=torch.int32, device=DEV)
    lens_s = torch.ones(B, dtype=torch.int32, device=DEV)
    scale = D ** -0.5

    def fill():
        q_s.copy_(torch.randn_like(q_s))
        bt_s.copy_(torch.randint(1, kc.shape[0], bt_s.shape, device=DEV, dtype=torch.int32))
        lens_s.copy_(torch.randint(1, max_len + 1, (B,), device=DEV, dtype=torch.int32))

    fill()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):                         # warm up (compile) outside the capture
        tk.paged_attention_decode(q_s, kc, vc, bt_s, lens_s, scale, max_len, fused_merge=fused_merge)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_s = tk.paged_attention_decode(q_s, kc, vc, bt_s, lens_s, scale, max_len, fused_merge=fused_merge)
    for i in range(6):
        fill()
        if i % 2:
            lens_s.copy_(torch.randint(1, 400, (B,), device=DEV, dtype=torch.int32))   # short contexts
        g.replay()
        ref = paged_attention_decode_ref(q_s.double(), kc.double(), vc.double(), bt_s, lens_s, scale)
        assert rel_err(out_s, ref) < TOL[torch.bfloat16]


# ---------------------------------------------------------------- fused sampling

def test_gumbel_sample_greedy_rows_are_argmax():
    from engine.kernels.sampling import gumbel_sample, gumbel_sample_ref
    V = 50_000 if GPU else 2500                             # several vocabulary chunks either way
    logits = rand(6, V) * 3
    logits[2, 7] = logits[2, V - 1] = logits[2].max() + 1   # a tie: the first index wins, as in torch
    temp = torch.tensor([0.0, 0.7, 0.0, 1.3, 0.0, 0.0], device=DEV)
    out = gumbel_sample(logits, temp, seed=11, chunk=8192 if GPU else 1024)
    greedy = temp <= 0
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(gumbel_sample_ref(logits, temp)[greedy], out[greedy])
    assert ((out >= 0) & (out < V)).all()


def test_gumbel_sample_matches_softmax_law():
    """Chi-square of many draws against softmax(logits / T), the law of the torch reference."""
    from scipy.stats import chisquare

    from engine.kernels.sampling import gumbel_sample
    V, T = (1000, 0.8)
    n_rows, n_draws = (4096, 8) if GPU else (160, 2)
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5)[:8 if not GPU else V].to(DEV)
    V = logits.numel()
    rows = logits.expand(n_rows, V).contiguous()
    counts = torch.zeros(V, dtype=torch.float64)
    for seed in range(n_draws):
        tok = gumbel_sample(rows, torch.full((n_rows,), T, device=DEV), seed=seed)
        counts += torch.bincount(tok.cpu(), minlength=V).double()
    expected = (logits.double().cpu() / T).softmax(-1) * counts.sum()
    big = expected >= 5                                     # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).numpy()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).numpy()
    assert chisquare(obs, exp).pvalue > 1e-3


@pytest.mark.parametrize("switches", [dict(gemv_variant="persistent", decode_fused_merge=True),
                                      dict(gemv_variant="tiled", decode_fused_merge=False)])
def test_decode_kernel_switches_match_torch(switches):
    """EngineConfig.gemv_variant / decode_fused_merge: greedy tokens of the Triton small-batch path (fp32) equal
    the torch path's on the same weights, and the switches reach the model."""
    from engine import LLMEngine, SamplingParams
    toks = {}
    for name, cfg in (("torch", dict(kernels="torch")), ("triton", dict(kernels="triton", **switches))):
        eng = LLMEngine(model="dummy:tiny", device=str(DEV), dtype="float32", num_kv_blocks=64,
                        enable_cuda_graphs=False, max_model_len=512, **cfg)
        if name == "triton":
            assert eng.model.gemv_variant == switches["gemv_variant"]
            assert eng.model.model.layers[0].self_attn.decode_fused_merge == switches["decode_fused_merge"]
        rid = eng.add_request(list(range(3, 300)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        out = {}
        while eng.has_unfinished_requests():
            out.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        toks[name] = out[rid]
    assert toks["triton"] == toks["torch"]


def test_small_batch_forward_matches_the_layered_path():
    """The model's small-batch path (fused linears + fused q/k/v-RoPE-store, Triton) against its layered torch
    path on the same weights: logits of every step of two short requests (prefill, then decodes of 1-2 tokens)."""
    from engine import LLMEngine, SamplingParams
    logs = {}
    for name, cfg in (("torch", dict(kernels="torch", gemv_max_tokens=0)), ("triton", dict(kernels="triton", gemv_max_tokens=8))):
        eng = LLMEngine(model="dummy:tiny", device=str(DEV), dtype="float32", num_kv_blocks=32, enable_cuda_graphs=False, **cfg)
        assert eng.model.gemv_max_tokens == cfg["gemv_max_tokens"]
        seen, execute = [], eng.runner.execute

        def spy(ids, md, seen=seen, execute=execute):
            out = execute(ids, md)
            seen.append((ids.numel(), out.cpu()))
            return out                                       # the engine samples from the device tensor
        eng.runner.execute = spy
        for p in ([5, 6, 7, 8, 9, 10, 11], [300, 200, 100]):
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
        logs[name] = seen
    assert [n for n, _ in logs["triton"]] == [n for n, _ in logs["torch"]] and min(n for n, _ in logs["torch"]) <= 2
    for (_, a), (_, b) in zip(logs["triton"], logs["torch"]):
        assert rel_err(a, b) < 1e-4
