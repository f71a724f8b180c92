"""EngineConfig.quant_gemm_group_dots under the interpreter: the int4 words GEMM, 8 dots a group."""
from __future__ import annotations

import pytest
import torch

from engine.kernels.quant_gemm import quant_matmul, quant_matmul_ref
from engine.quant.formats import int4_to_words, quantize

pytestmark = pytest.mark.slow


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
def test_model_with_group_dots_matches_torch(fmt):
    """set_packed with group_dots: the prefill on the group-dots GEMM (int4), then a decode step; logits as the
    torch path's."""
    from engine.quant.linear import set_packed, set_tensor_cores
    from tests.helpers import PACKED_IDS as ids, packed_model_and_ref
    from tests.test_quant import _prefill_then_decode
    model, ref = packed_model_and_ref(fmt)
    set_packed(model, True, group_dots=True)
    set_tensor_cores(model, None)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.packed and qkv.group_dots
    for a, b in zip(ref, _prefill_then_decode(model, ids)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
