"""int4 weights on CPU through torch's CPU int4 GEMM (quant/linear.py set_cpu_int4): the kernel against the
dequantized reference, and an engine whose decoder projections and LM head run on it (accuracy on the bundled
model against fp32: benchmarks/check_cpu_quant.py)."""
import pytest
import torch
import torch.nn.functional as F

from engine import LLMEngine, SamplingParams
from engine.kernels import cpu_kernels
from engine.quant import formats
from engine.quant.linear import QuantLinear, RescoredLMHead, set_cpu_int4

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="no aten._weight_int4pack_mm_for_cpu")


@pytest.mark.parametrize("M,G", [(1, 32), (5, 32), (3, 64)])
def test_cpu_int4_matches_dequantized_reference(M, G):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(96, 128, generator=g)
    lin = QuantLinear("int4", 128, 96, torch.randn(96, generator=g), "cpu", formats.quantize(w, "int4", G))
    x = torch.randn(M, 128, generator=g)
    ref = F.linear(x, lin.dequantize(torch.float32), lin.bias)
    set_cpu_int4(lin)
    out = lin(x)
    assert out.dtype == x.dtype and out.shape == (M, 96)
    # bf16 activations, scales and zero points: ~3 significant digits
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("V,K,T", [(4096, 64, 3), (1040, 96, 1), (48, 32, 2)])
def test_rescored_lm_head_gives_float_logits_to_its_top_candidates(V, K, T):
    """The int4 head's top 8 of each row carry the float head's logits (found through chunk maxima where the
    vocabulary is large, a plain top-k where it is small); the rest stay the int4 head's."""
    g = torch.Generator().manual_seed(V)
    w = torch.randn(V, K, generator=g)
    q = QuantLinear("int4", K, V, None, "cpu", formats.quantize(w, "int4", 32))
    set_cpu_int4(q)
    head = RescoredLMHead(q, w)
    x = torch.randn(T, K, generator=g)
    approx, out, exact = q(x), head(x), x @ w.T
    changed = out != approx                                               # [T, V]
    assert changed.sum(-1).tolist() == [min(8, V)] * T
    torch.testing.assert_close(out[changed], exact[changed], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~changed], approx[~changed])
    # the rescored are the int4 head's best (up to ties of its bf16-rounded logits)
    assert (approx[changed].view(T, -1).min(-1).values >= approx.topk(min(8, V), -1).values[:, -1]).all()


def test_int4_engine_on_cpu_runs_projections_and_lm_head_on_the_int4_gemm(one_thread):
    eng = LLMEngine(model="dummy:tiny", device="cpu", quantization="int4", int4_group_size=32, num_kv_blocks=32)
    model = eng.model
    head = model.lm_head
    assert isinstance(head, RescoredLMHead) and head.q.cpu_int4 is not None
    assert head.weight is model.model.embed_tokens.weight                 # tied: no second float table
    assert all(lin.cpu_int4 is not None for layer in model.model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj))
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)      # lookups stay on the float table
    assert eng.weights_description == "int4 (groups of 32)"               # what the app's header says
    attention = "C++" if cpu_kernels.loaded() else "torch"          # C++ wherever the session could build it
    assert eng.kernels_description == f"torch kernels, {attention} decode attention"
    free = eng.block_manager.num_free_blocks
    eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert len(outs[0].token_ids) == 6 and eng.block_manager.num_free_blocks == free
