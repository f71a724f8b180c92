"""The packed GEMV's switches under the interpreter (plain decodes; the inline-PTX f16x2 pair decode runs compiled
only: tests/test_gpu_quant_packed.py): EngineConfig.quant_int8_pairs (int8 at one token, two words a step),
quant_qkv_split_rope (q/k/v at one token: split-K GEMV, then RoPE + store), quant_gemm_group_dots (the int4 words
GEMM, 8 dots a group)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref
from engine.kernels.quant_gemv import quant_fused_linear_ref
from engine.kernels.quant_gemv_packed import quant_fused_linear_packed
from engine.quant.formats import dequantize, int4_to_words, quantize
from helpers import every_code_weights

ON = SimpleNamespace(quant_int8_pairs=True, quant_qkv_split_rope=True, quant_gemm_group_dots=True)


class _Spy:
    def __init__(self, kernel):
        self.kernel, self.kwargs = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.kwargs.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("prologue,split", [(None, 1), ("rms_norm", 3), ("silu_mul", 2)])
def test_int8_pairs_matches_reference(prologue, split, monkeypatch):
    """Odd N, K a multiple of 8 but not of the tile, bias + residual, split-K (workspace left zero); the kernel
    runs PAIRS at M = 1 only (M = 3: the rows share a program, as before)."""
    from engine.kernels import quant_gemv_packed as q
    spy = _Spy(q._pk_gemv_kernel)
    monkeypatch.setattr(q, "_pk_gemv_kernel", spy)
    torch.manual_seed(3)
    N, K = 37, 232
    t = quantize(torch.randn(N, K) * 0.05, "int8")
    for M in (1, 3):
        x = torch.randn(M, 2 * K if prologue == "silu_mul" else K)
        nw = torch.rand(K) + 0.5 if prologue == "rms_norm" else None
        bias, res = torch.randn(N), torch.randn(M, N)
        kw = dict(prologue=prologue, norm_weight=nw, residual=res, config=(8, 64, 1, split, 2), pairs=True)
        y = quant_fused_linear_packed(x, "int8", t, (N, K), bias, **kw)
        ref = quant_fused_linear_ref(x, "int8", t, (N, K), bias, prologue=prologue, norm_weight=nw, residual=res)
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        assert spy.kwargs[-1]["PAIRS"] == (M == 1)
        if split > 1:
            torch.testing.assert_close(quant_fused_linear_packed(x, "int8", t, (N, K), bias, **kw), y)


def test_int8_pairs_decodes_every_code_exactly():
    K = 256
    t = every_code_weights("int8", K)
    w = dequantize("int8", t, (2, K))
    x = torch.eye(K)
    y = torch.cat([quant_fused_linear_packed(x[i:i + 1], "int8", t, (2, K), config=(2, 128, 1, 1, 0), pairs=True)
                   for i in range(0, K, 37)])
    torch.testing.assert_close(y, w.T[::37], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_int4_group_dots_matches_reference(dtype):
    """Groups of 128 (K a partial group past two), M and N odd; groups of 32 keep the interleaved tile."""
    torch.manual_seed(2)
    M, N, K = 19, 37, 300
    for group in (128, 32):
        t = int4_to_words(quantize(torch.randn(N, K) * 0.05, "int4", group))
        x, bias = torch.randn(M, K).to(dtype), torch.randn(N).to(dtype)
        y = quant_matmul(x, "int4", t, (N, K), bias, config=(16, 32, 4, 1), group_dots=True)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), quant_matmul_ref(x, "int4", t, (N, K), bias).float(), atol=tol,
                                   rtol=tol)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_model_with_switches_matches_torch(fmt, monkeypatch):
    """set_packed with every switch on: the prefill on the group-dots GEMM (int4), the decode step's q/k/v as the
    GEMV then RoPE + store, int8 on the pair decode; logits as the torch path's."""
    from engine.kernels import rope
    from engine.quant.linear import set_packed, set_tensor_cores
    from tests.helpers import PACKED_IDS as ids, packed_model_and_ref
    from tests.test_quant import _prefill_then_decode
    calls = []
    real = rope.rope_and_store
    monkeypatch.setattr(rope, "rope_and_store", lambda *a, **k: (calls.append(a[0].shape[0]), real(*a, **k)))
    model, ref = packed_model_and_ref(fmt)
    set_packed(model, True, ON)
    set_tensor_cores(model, None)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.split_rope and qkv.group_dots and qkv.pairs == (fmt == "int8")
    for a, b in zip(ref, _prefill_then_decode(model, ids)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert 1 in calls                   # the one-token step took the split q/k/v
