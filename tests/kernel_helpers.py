"""Shared by the kernel tests: the device they run on, tolerances, random inputs."""
import os

import pytest
import torch

from engine.kernels.metadata import AttentionMetadata

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


def qkv_views(T, H, Hk, D, dtype):
    """q [T, H, D], k/v [T, Hk, D]: non-contiguous views of one fused projection output."""
    qkv = rand(T, (H + 2 * Hk) * D, dtype=dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hk) * D].view(T, Hk, D)
    v = qkv[:, (H + Hk) * D:].view(T, Hk, D)
    return q, k, v


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
    q = qkv_views(T, H, Hk, D, dtype)[0]                          # strided like the model's q
    return q, kc, vc, md
