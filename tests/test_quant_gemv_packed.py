"""The packed-word decode GEMV (engine/kernels/quant_gemv_packed.py, EngineConfig.quant_gemv_packed) and the int4
words layout (formats.int4_to_words) under the interpreter: the plain decodes (the inline-PTX ones run compiled
only: tests/test_gpu_quant.py), every prologue / epilogue, M = 1 / 3, split-K, odd sizes."""
from __future__ import annotations

import pytest
import torch
import triton

from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref
from engine.kernels.quant_gemv import quant_fused_linear_ref
from engine.kernels.quant_gemv_packed import quant_fused_linear_packed
from engine.kernels.quant_packed_configs import QUANT_GEMV_PACKED_CONFIGS, quant_gemv_packed_config, rows_on_grid_default
from engine.quant.formats import dequantize, int4_codes, int4_group, int4_to_words, quantize
from helpers import every_code_weights


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_words_layout_is_exact(group):
    """Repacking to words keeps every code; nibble j of word i of group g is k = G g + j G / 8 + i."""
    torch.manual_seed(0)
    N, K = 5, 3 * group - 7
    t = quantize(torch.randn(N, K), "int4", group)
    tw = int4_to_words(t)
    assert tw["qweight"].dtype == torch.int32 and tw["qweight"].shape == (N, 3 * group // 8)
    assert int4_group(tw) == group and int4_to_words(tw) is tw
    assert torch.equal(dequantize("int4", tw, (N, K)), dequantize("int4", t, (N, K)))
    codes, S = int4_codes(t), group // 8
    w = tw["qweight"]
    for n, g, j, i in ((0, 0, 0, 0), (4, 2, 7, S - 1), (2, 1, 3, 1)):
        assert (int(w[n, g * S + i]) >> (4 * j)) & 15 == int(codes[n, g * group + j * S + i])


CASES = [("int4", 32, None, 1), ("int4", 64, "rms_norm", 3), ("int4", 128, "silu_mul", 2),
         ("int8", 0, None, 1), ("int8", 0, "rms_norm", 3), ("int8", 0, "silu_mul", 2),
         ("fp8", 0, "rms_norm", 1), ("fp8", 0, "silu_mul", 3)]


@pytest.mark.slow
@pytest.mark.parametrize("fmt,group,prologue,split", CASES)
def test_packed_gemv_matches_reference(fmt, group, prologue, split):
    """Odd N and K (int4: K not a multiple of the group), N over two row blocks, bias + residual, M = 1 and 3,
    split-K (the workspace is left zero: a second call gives the same result)."""
    torch.manual_seed(1)
    N, K = (40, 236) if fmt == "fp8" else (37, 236)
    t = quantize(torch.randn(N, K) * 0.05, fmt, group or 128)
    if fmt == "int4":
        t = int4_to_words(t)
    bk = 2 * group if fmt == "int4" else 64
    for M, dtype in ((1, torch.float32), (3, torch.float16)):
        x = torch.randn(M, 2 * K if prologue == "silu_mul" else K).to(dtype)
        nw = (torch.rand(K) + 0.5).to(dtype) if prologue == "rms_norm" else None
        bias, res = torch.randn(N).to(dtype), torch.randn(M, N).to(dtype)
        cfg = (32, bk, 1, split, 2 if M == 1 else 0)
        y = quant_fused_linear_packed(x, fmt, t, (N, K), bias, prologue=prologue, norm_weight=nw, residual=res,
                                      config=cfg)
        ref = quant_fused_linear_ref(x, fmt, t, (N, K), bias, prologue=prologue, norm_weight=nw, residual=res)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(y.float(), ref.float(), atol=tol, rtol=tol)
        if split > 1:
            y2 = quant_fused_linear_packed(x, fmt, t, (N, K), bias, prologue=prologue, norm_weight=nw, residual=res,
                                           config=cfg)
            torch.testing.assert_close(y2, y)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4"])
def test_packed_gemv_decodes_every_code_exactly(fmt):
    """One-hot activations read single weights back: every code of the format, exact in fp32."""
    K = 256
    t = every_code_weights(fmt, K)
    w = dequantize(fmt, t, (2, K))
    ok = torch.isfinite(w[0])
    x = torch.eye(K)[ok]
    y = torch.cat([quant_fused_linear_packed(x[i:i + 1], fmt, t, (2, K), config=(2, 128, 1, 1, 0))
                   for i in range(0, x.shape[0], 37)])
    torch.testing.assert_close(y, w[:, ok].T[::37], atol=0, rtol=0)


def test_packed_config_table_and_rule():
    for (fmt, N, K), cfg in QUANT_GEMV_PACKED_CONFIGS.items():
        assert quant_gemv_packed_config(fmt, 1, N, K) == cfg
        assert fmt != "fp8" or 128 % cfg[0] == 0
        assert fmt != "int4" or cfg[1] % 128 == 0
    bn, bk, warps, split, flags = quant_gemv_packed_config("int4", 1, 4096, 14336)
    assert split >= 1 and flags in (0, 1, 2, 3)
    assert quant_gemv_packed_config("int8", 8, 4096, 4096)[1] <= quant_gemv_packed_config("int8", 1, 4096, 4096)[1]


@pytest.mark.slow
def test_quant_qkv_rope_store_packed_matches_reference():
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store, quant_fused_qkv_rope_store_ref
    torch.manual_seed(4)
    for fmt, group in (("int4", 32), ("int8", 128)):
        (H, Hk), D, K, bs = (2, 1), 32, 200, 4
        N = (H + 2 * Hk) * D
        t = quantize(torch.randn(N, K) * 0.05, fmt, group)
        if fmt == "int4":
            t = int4_to_words(t)
        cos_sin = torch.randn(64, D)
        for M, bias, cfg in ((1, False, (16, 64, 1, 1, 2)), (3, True, None)):
            x = torch.randn(M, K)
            nw = torch.rand(K) + 0.5
            b = torch.randn(N) if bias else None
            positions = torch.randint(0, 64, (M,))
            slots = torch.tensor([5, -1, 9][:M])
            kc, vc = torch.randn(4, bs, Hk, D), torch.randn(4, bs, Hk, D)
            kc_ref, vc_ref = kc.clone(), vc.clone()
            q = quant_fused_qkv_rope_store(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc, vc, slots,
                                           packed=True, config=cfg)
            q_ref = quant_fused_qkv_rope_store_ref(x, fmt, t, (N, K), b, nw, 1e-5, H, Hk, positions, cos_sin, kc_ref,
                                                   vc_ref, slots)
            torch.testing.assert_close(q, q_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(kc, kc_ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(vc, vc_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", [32, 128])
def test_quant_gemm_int4_words_matches_reference(group):
    torch.manual_seed(2)
    M, N, K = 19, 37, 300
    t = int4_to_words(quantize(torch.randn(N, K) * 0.05, "int4", group))
    x, bias = torch.randn(M, K), torch.randn(N)
    torch.testing.assert_close(quant_matmul(x, "int4", t, (N, K), bias, config=(16, 32, 4, 1)),
                               quant_matmul_ref(x, "int4", t, (N, K), bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_quantized_model_packed_matches_torch(fmt):
    """Inside the model with quant/linear.py's set_packed on (int4 repacked to words: the GEMM for the prefill,
    the packed GEMVs and q/k/v + RoPE for the decode step) the logits are the torch path's; off again restores the
    byte layout exactly."""
    from engine.quant.linear import set_packed, set_tensor_cores
    from tests.helpers import PACKED_IDS as ids, packed_model_and_ref
    from tests.test_quant import _prefill_then_decode
    model, ref = packed_model_and_ref(fmt)
    lin = model.model.layers[0].mlp.down_proj
    before = {k: v.clone() for k, v in lin.tensors().items()}
    set_packed(model, True, group_dots=True)
    set_tensor_cores(model, False)
    assert lin.packed and (fmt != "int4" or lin.qweight.dtype == torch.int32)
    for a, b in zip(ref, _prefill_then_decode(model, ids)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    set_packed(model, False, group_dots=True)
    assert not lin.packed and all(torch.equal(v, before[k]) for k, v in lin.tensors().items())


class _GridSpy:
    """Stands in for a @triton.jit kernel: records each launch's grid and constexprs, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.slow
@pytest.mark.parametrize("prologue", [None, "rms_norm", "silu_mul"])
def test_packed_int4_rows_on_grid(prologue, monkeypatch):
    """int4 at M > 1 runs each row as its own programs (the kernel's ROWS: grid (M, row blocks, K chunks), the M = 1
    dot, launched with M = 1), the H200-verified M = 1 path; int8 keeps its rows in one program. Both give the
    reference: odd N over two row blocks, K a partial group past three, M = 2 (split-K 1) and a padded M = 3 (split-K
    3, clamped to the 2 chunks there are; the workspace left zero)."""
    from engine.kernels import quant_gemv_packed as q
    spy = _GridSpy(q._pk_gemv_kernel)
    monkeypatch.setattr(q, "_pk_gemv_kernel", spy)
    torch.manual_seed(7)
    N, K, group = 37, 3 * 64 + 20, 64
    t = int4_to_words(quantize(torch.randn(N, K) * 0.05, "int4", group))
    for M, split in ((2, 1), (3, 3)):
        x = torch.randn(M, 2 * K if prologue == "silu_mul" else K)
        nw = torch.rand(K) + 0.5 if prologue == "rms_norm" else None
        bias, res = torch.randn(N), torch.randn(M, N)
        ref = quant_fused_linear_ref(x, "int4", t, (N, K), bias, prologue=prologue, norm_weight=nw, residual=res)
        for rows in (None, False):
            spy.launches.clear()
            cfg = (32, 2 * group, 1, split, 0)
            kw = dict(prologue=prologue, norm_weight=nw, residual=res, config=cfg, rows_on_grid=rows)
            y = quant_fused_linear_packed(x, "int4", t, (N, K), bias, **kw)
            torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
            if split > 1:
                torch.testing.assert_close(quant_fused_linear_packed(x, "int4", t, (N, K), bias, **kw), y)
            grid, args, kwargs = spy.launches[0]
            nb, chunks = triton.cdiv(N, 32), min(split, 2)           # 4 groups of 64 in tiles of 2: 2 chunks at most
            if rows is None:                                          # the default: rows on the grid
                assert grid == (M, nb, chunks) and kwargs["ROWS"] and kwargs["BLOCK_M"] == 1 and args[10] == 1
            else:
                assert grid == (nb, chunks) and not kwargs["ROWS"] and kwargs["BLOCK_M"] == triton.next_power_of_2(M) and args[10] == M


def test_packed_routing_by_format_and_rows(monkeypatch):
    """The default row placement per format, the M > 1 tiles (int4: its M = 1 tiles), and the int4 q/k/v + RoPE at
    M > 1 through the packed GEMV with the rows on the grid and the RoPE + store kernel (not the RoPE kernel's
    shared-row packed dot), matching the reference; at M = 1 the RoPE kernel's packed dot as before."""
    from engine.kernels import quant_gemv_packed as q
    from engine.kernels import quant_qkv_rope
    from engine.kernels.quant_qkv_rope import quant_fused_qkv_rope_store_ref
    from engine.quant.linear import QuantLinear
    assert rows_on_grid_default("int4") and not rows_on_grid_default("int8") and not rows_on_grid_default("fp8")
    for M in (2, 4, 16):
        assert quant_gemv_packed_config("int4", M, 4096, 14336) == quant_gemv_packed_config("int4", 1, 4096, 14336)
    spy = _GridSpy(q._pk_gemv_kernel)
    monkeypatch.setattr(q, "_pk_gemv_kernel", spy)
    packed_rope = []
    real = quant_qkv_rope.quant_fused_qkv_rope_store

    def rope_spy(*args, **kwargs):
        packed_rope.append(kwargs.get("packed"))
        return real(*args, **kwargs)
    monkeypatch.setattr(quant_qkv_rope, "quant_fused_qkv_rope_store", rope_spy)
    torch.manual_seed(5)
    (H, Hk), D, K, bs = (2, 1), 32, 128, 4
    N = (H + 2 * Hk) * D
    lin = QuantLinear("int4", K, N, None, "cpu", int4_to_words(quantize(torch.randn(N, K) * 0.05, "int4", 32)))
    lin.kernels, lin.packed = "triton", True
    cos_sin = torch.randn(64, D)
    for M in (1, 3):
        spy.launches.clear()
        packed_rope.clear()
        x, nw = torch.randn(M, K), torch.rand(K) + 0.5
        positions, slots = torch.randint(0, 64, (M,)), torch.tensor([5, -1, 9][:M])
        kc, vc = torch.randn(4, bs, Hk, D), torch.randn(4, bs, Hk, D)
        kr, vr = kc.clone(), vc.clone()
        out = lin.fused_qkv_rope_store(x, nw, 1e-5, H, Hk, positions, cos_sin, kc, vc, slots)
        ref = quant_fused_qkv_rope_store_ref(x, "int4", lin.tensors(), (N, K), None, nw, 1e-5, H, Hk, positions,
                                             cos_sin, kr, vr, slots)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kc, kr, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vc, vr, atol=1e-4, rtol=1e-4)
        if M == 1:
            assert packed_rope == [True] and not spy.launches
        else:
            assert packed_rope == [] and len(spy.launches) == 1 and spy.launches[0][2]["ROWS"]
