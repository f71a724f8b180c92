"""Shared by the kernel tests: the device they run on, tolerances, random inputs."""
import os

import pytest
import torch

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
