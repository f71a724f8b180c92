"""Paged attention kernels (prefill, split decode, fused merge, CUDA-graph replay) vs the float64 references.

CPU: under the Triton interpreter with small shapes; GPU (TRITON_INTERPRET=0 and CUDA): full sizes, bf16 too.
"""
import dataclasses

import pytest
import torch

from engine.kernels import ops
from engine.kernels import triton_ops as tk
from engine.kernels.paged_attention_ref import paged_attention_decode_ref, paged_attention_ref
from kernel_helpers import DEV, DTYPES, GPU, TOL, gpu_only, make_batch, rel_err

# ---------------------------------------------------------------- paged attention

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


@pytest.mark.parametrize("block_m,block_n,apart", [(16, 16, True), (64, 16, False), (128, 128, True)])
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


@pytest.mark.parametrize("empty", [1, 7])
def test_paged_attention_trailing_empty_sequences(empty):
    # a mixed CUDA graph's layout: sequence slots past the step's own hold no queries (cu_seqlens_q = T, length
    # 0); their programs return at once and the real rows are unchanged
    q, kc, vc, md = make_batch([1, 13, 6], [30, 13, 44], bs=4, dtype=torch.float32, **SMALL)
    B, T = md.num_seqs, q.shape[0]
    cu = torch.cat([md.cu_seqlens_q, torch.full((empty,), T, dtype=torch.int32, device=DEV)])
    lens = torch.cat([md.seq_lens, torch.zeros(empty, dtype=torch.int32, device=DEV)])
    tables = torch.cat([md.block_tables, torch.zeros(empty, md.block_tables.shape[1], dtype=torch.int32,
                                                     device=DEV)])
    slots = dataclasses.replace(md, cu_seqlens_q=cu, seq_lens=lens, block_tables=tables, q_lens=md.q_lens + [0] * empty,
                                seq_lens_cpu=md.seq_lens_cpu + [0] * empty)
    scale = q.shape[-1] ** -0.5
    out = torch.full(q.shape, float("nan"), device=DEV, dtype=torch.float32)
    tk.paged_attention(q, kc, vc, slots, scale, out=out)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), md, scale)
    assert slots.num_seqs == B + empty and rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("H,Hk,D", [(4, 4, 16), (8, 1, 24)])  # no GQA; MQA with D not a power of two
def test_paged_attention_head_shapes(H, Hk, D):
    _check_attention(*make_batch([1, 6], [9, 21], H, Hk, D, 8, torch.float32), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_paged_attention_decode_split(dtype, splits):
    # lengths 1 and short ones leave some splits empty; one is long enough for several tiles per split
    seq_lens = [1, 130, 7, 64] + ([4096, 3000, 33] * 10 if GPU else [])
    shp = dict(H=32, Hk=8, D=128) if GPU else SMALL
    q, kc, vc, md = make_batch([1] * len(seq_lens), seq_lens, bs=16, dtype=dtype, **shp)
    scale = q.shape[-1] ** -0.5
    out = tk.paged_attention_decode(q, kc, vc, md.block_tables, md.seq_lens, scale, md.max_seqlen_k,
                                    num_splits=splits)
    ref = paged_attention_decode_ref(q.double(), kc.double(), vc.double(), md.block_tables, md.seq_lens, scale)
    assert rel_err(out, ref) < TOL[dtype]


def test_decode_padded_rows_are_zero():
    q, kc, vc, md = make_batch([1, 1], [5, 40], bs=8, dtype=torch.float32, **SMALL)
    lens = md.seq_lens.clone()
    lens[0] = 0                                              # a CUDA-graph padding row
    for splits in (1, 4):
        out = torch.full_like(q, float("nan"))
        tk.paged_attention_decode(q, kc, vc, md.block_tables, lens, 0.2, 64, num_splits=splits, out=out)
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
def test_decode_cuda_graph():
    """Capture once with static buffers, then replay with new lengths, tables and queries (short contexts leave
    most splits idle)."""
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
        tk.paged_attention_decode(q_s, kc, vc, bt_s, lens_s, scale, max_len)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_s = tk.paged_attention_decode(q_s, kc, vc, bt_s, lens_s, scale, max_len)
    for i in range(6):
        fill()
        if i % 2:
            lens_s.copy_(torch.randint(1, 400, (B,), device=DEV, dtype=torch.int32))   # short contexts
        g.replay()
        ref = paged_attention_decode_ref(q_s.double(), kc.double(), vc.double(), bt_s, lens_s, scale)
        assert rel_err(out_s, ref) < TOL[torch.bfloat16]
