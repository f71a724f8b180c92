"""The two-launch FP8 GEMM (engine/kernels/quant_gemm_fp8.py) against torch, under the Triton interpreter on CPU
(the GPU test_gpu_quant.py checks it at 8B sizes on real fp8 conversions), and EngineConfig.fp8_gemm's checks."""
import pytest
import torch

from engine import EngineConfig
from engine.kernels.quant_gemm_fp8 import fp8_matmul, gemm_fp8, quantize_activations_fp8
from engine.quant.formats import BLOCK, FP8_DTYPE, FP8_MAX, dequantize, quantize
from engine.quant.linear import QuantLinear, set_fp8_gemm


def _exact_activations(M: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] whose every 128-group is fp8 codes (one of them +-448) times a power of two: quantizing it is
    exact, so the kernel's output is known without rounding (the interpreter's fp32 -> fp8 cast rounds wrongly
    near binade edges; the GPU test covers rounding). Returns x, its codes and its group scales [M, K / 128]."""
    g = torch.Generator().manual_seed(seed)
    kb = -(-K // BLOCK)
    codes = (torch.randn(M, kb * BLOCK, generator=g) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes = codes[:, :K].clone()
    for j in range(kb):                                   # the group's largest magnitude is exactly 448
        codes[:, j * BLOCK] = FP8_MAX * torch.where(torch.rand(M, generator=g) < 0.5, -1.0, 1.0)
    scales = 2.0 ** torch.randint(-12, 0, (M, kb), generator=g).float()
    x = codes * scales.repeat_interleave(BLOCK, 1)[:, :K]
    return x, codes, scales


@pytest.mark.parametrize("M,K", [(1, 128), (5, 300), (37, 256), (70, 130)])
def test_activation_quantization_exact(M, K):
    x, codes, scales = _exact_activations(M, K, seed=M + K)
    q, s = quantize_activations_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == (M, K)
    assert s.shape == (M, -(-K // BLOCK)) and s.stride(0) == 1          # column-major, as cuBLAS reads it
    assert torch.equal(s, scales)
    assert torch.equal(q.float(), codes)
    qp, sp = quantize_activations_fp8(x, row_align=16)           # cuBLAS's padded rows: zeros
    Mp = -(-M // 16) * 16
    assert qp.shape == (Mp, K) and sp.shape == (Mp, s.shape[1]) and sp.stride() == (1, Mp)
    assert torch.equal(qp[:M].float(), codes) and torch.equal(sp[:M], scales)
    assert not qp[M:].float().any()


def test_activation_quantization_zero_rows():
    q, s = quantize_activations_fp8(torch.zeros(3, 256))
    assert torch.equal(q.float(), torch.zeros(3, 256)) and bool((s > 0).all())      # no 0 / 0


@pytest.mark.parametrize("M,N,K", [(3, 136, 300), (37, 200, 256), (70, 130, 140)])
@pytest.mark.parametrize("config", [None, (16, 64, 4, 2), (32, 128, 4, 3)])
def test_gemm_fp8_matches_torch(M, N, K, config):
    torch.manual_seed(M * N)
    x, codes, scales = _exact_activations(M, K, seed=K)
    t = quantize(torch.randn(N, K) * 0.02, "fp8")
    bias = torch.randn(N)
    q, s = quantize_activations_fp8(x)
    y = gemm_fp8(q, s, t["weight"], t["weight_scale_inv"], torch.float32, bias, config=config)
    ref = x @ dequantize("fp8", t, (N, K)).t() + bias
    assert float((y - ref).norm() / ref.norm()) < 1e-5
    y2 = fp8_matmul(x, t, bias, "triton")
    assert float((y2 - ref).norm() / ref.norm()) < 1e-5


def test_fp8_gemm_config_checks():
    with pytest.raises(ValueError, match="fp8_gemm"):
        EngineConfig(model="dummy:llama-3.2-1b", fp8_gemm="cutlass")
    lin = QuantLinear("fp8", 256, 128, None, "cpu")
    lin.act_fp8 = True

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.mlp = torch.nn.Module()
            self.self_attn.qkv_proj, self.self_attn.o_proj = lin, QuantLinear("fp8", 128, 128, None, "cpu")
            self.mlp.gate_up_proj, self.mlp.down_proj = QuantLinear("int8", 128, 128, None, "cpu"), lin

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([Layer()])
    set_fp8_gemm(model, "auto")                          # no cuBLAS block-wise scaled_mm on a CPU
    assert lin.fp8_gemm == "triton"
    with pytest.raises(ValueError, match="fp8_gemm.*cublas"):
        set_fp8_gemm(model, "cublas")
    set_fp8_gemm(model, "fused")
    assert lin.fp8_gemm == "fused" and model.model.layers[0].self_attn.o_proj.fp8_gemm == "fused"   # act_fp8 off


@pytest.mark.parametrize("M,N,residual,align", [(5, 256, True, 1), (13, 512, False, 4), (1, 128, True, 4)])
def test_rms_norm_fp8_matches_norm_then_quantize(M, N, residual, align):
    """The fused norm (EngineConfig.fp8_act_fusion) writes the very codes and scales of rms_norm followed by
    quantize_activations_fp8 (the same interpreter cast on both sides), and the same new residual."""
    from engine.kernels.fp8_act_fusions import rms_norm_fp8
    from engine.kernels.rmsnorm import rms_norm
    g = torch.Generator().manual_seed(M * N)
    x = torch.randn(M, N, generator=g)
    r = torch.randn(M, N, generator=g) if residual else None
    w = torch.rand(N, generator=g) + 0.5
    act, res = rms_norm_fp8(x, w, 1e-5, r, row_align=align)
    h, res_ref = rms_norm(x, w, 1e-5, r)
    q, s = quantize_activations_fp8(h)
    Mp = -(-M // align) * align
    assert act.rows == M and act.q.shape == (Mp, N) and act.s.shape == (Mp, N // BLOCK) and act.dtype == x.dtype
    assert torch.equal(act.q[:M].float(), q.float()) and torch.equal(act.s[:M], s)
    assert not act.q[M:].float().any()
    assert torch.equal(res, res_ref)


@pytest.mark.parametrize("M,I,align", [(3, 384, 1), (9, 512, 4)])
def test_silu_and_mul_fp8_matches_then_quantize(M, I, align):
    from engine.kernels.activation import silu_and_mul
    from engine.kernels.fp8_act_fusions import silu_and_mul_fp8
    x = torch.randn(M, 2 * I, generator=torch.Generator().manual_seed(I))
    act = silu_and_mul_fp8(x, row_align=align)
    q, s = quantize_activations_fp8(silu_and_mul(x))
    assert act.rows == M and act.q.shape[0] == -(-M // align) * align
    assert torch.equal(act.q[:M].float(), q.float()) and torch.equal(act.s[:M], s)
    assert not act.q[M:].float().any()
    t = quantize(torch.randn(256, I) * 0.02, "fp8")
    assert torch.equal(fp8_matmul(act, t, None, "triton"), fp8_matmul(silu_and_mul(x), t, None, "triton"))


def test_fp8_act_row_align():
    from engine.kernels.quant_gemm_fp8 import CUBLAS_ROW_ALIGN
    from engine.quant.linear import fp8_act_row_align

    def model(hidden, inter, mode, quant_down=True):
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
        layer.self_attn.qkv_proj = QuantLinear("fp8", hidden, 3 * 128, None, "cpu")
        layer.mlp.gate_up_proj = QuantLinear("fp8", hidden, 2 * inter, None, "cpu")
        layer.mlp.down_proj = QuantLinear("fp8", inter, hidden, None, "cpu") if quant_down \
            else torch.nn.Linear(inter, hidden)
        for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin.act_fp8, lin.fp8_gemm = True, mode
        m = torch.nn.Module()
        m.model = torch.nn.Module()
        m.model.layers = torch.nn.ModuleList([layer])
        return m

    assert fp8_act_row_align(model(256, 384, "triton")) == 1
    assert fp8_act_row_align(model(256, 384, "cublas")) == CUBLAS_ROW_ALIGN
    assert fp8_act_row_align(model(256, 384, "fused")) == 0            # the GEMM quantizes itself
    assert fp8_act_row_align(model(576, 384, "triton")) == 0           # hidden not a power of two
    assert fp8_act_row_align(model(256, 200, "triton")) == 0           # intermediate not whole groups
    assert fp8_act_row_align(model(256, 384, "triton", quant_down=False)) == 0


def test_fp8_act_fusion_in_the_model_cpu(tmp_path, monkeypatch):
    """The model's GEMM path with the norms and SiLU-and-mul quantizing for the FP8 GEMMs gives the tokens of the
    unfused path (the same codes reach the same GEMMs). Interpreter: the engine turns FP8 activations on only on
    CUDA, so the test sets the layers as set_fp8_gemm would there."""
    import transformers

    from engine import LLMEngine, SamplingParams
    from engine.kernels import fp8_act_fusions
    from engine.quant.linear import fp8_act_row_align
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=64, vocab_size=300, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, safe_serialization=True)
    calls = []
    real = fp8_act_fusions.rms_norm_fp8
    monkeypatch.setattr(fp8_act_fusions, "rms_norm_fp8", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(fuse: bool) -> list[list[int]]:
        eng = LLMEngine(model=str(tmp_path), device="cpu", kernels="triton", quantization="fp8", block_size=4,
                        max_num_batched_tokens=16, num_kv_blocks=64, enable_prefix_caching=False)
        for lin in eng.model.modules():
            if isinstance(lin, QuantLinear):
                lin.act_fp8, lin.fp8_gemm = True, "triton"
        eng.model.fp8_act_align = fp8_act_row_align(eng.model) if fuse else 0
        assert eng.model.fp8_act_align == (1 if fuse else 0)
        g = torch.Generator().manual_seed(1)
        ids = [eng.add_request(torch.randint(0, 300, (n,), generator=g).tolist(),
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)) for n in (5, 11, 3)]
        outs = {}
        while eng.has_unfinished_requests():
            outs.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        return [outs[i] for i in ids]

    off = run(False)
    assert not calls
    on = run(True)
    assert calls and on == off
