"""int4 weights on the CPU int4 path (quant/linear.py set_cpu_int4): kvscope::int4_linear's C++ kernel where the
session built it (tests/test_cpu_kernels.py checks the op itself), torch's CPU int4 GEMM where asked for or unbuilt,
against the dequantized reference, and an engine whose decoder projections and LM head run on it (accuracy on the
bundled model against fp32: benchmarks/check_cpu_quant.py)."""
import pytest
import torch
import torch.nn.functional as F

from engine import LLMEngine, SamplingParams
from engine.kernels import cpu_kernels
from engine.quant import formats
from engine.quant.linear import QuantLinear, RescoredLMHead, set_cpu_int4

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="no aten._weight_int4pack_mm_for_cpu")


@pytest.mark.parametrize("torch_gemm", [False, True])
@pytest.mark.parametrize("M,G", [(1, 32), (5, 32), (3, 64)])
def test_cpu_int4_matches_dequantized_reference(M, G, torch_gemm):
    g = torch.Generator().manual_seed(M)
    w = torch.randn(96, 128, generator=g)
    lin = QuantLinear("int4", 128, 96, torch.randn(96, generator=g), "cpu", formats.quantize(w, "int4", G))
    x = torch.randn(M, 128, generator=g)
    ref = F.linear(x, lin.dequantize(torch.float32), lin.bias)
    set_cpu_int4(lin, torch_gemm=torch_gemm and not cpu_kernels.loaded())
    assert lin.cpu_int4 == G and (lin.cpu_int4_pack is None) == (not torch_gemm or cpu_kernels.loaded())
    out = lin(x)
    assert out.dtype == x.dtype and out.shape == (M, 96)
    # int8 activations (C++) or bf16 activations, scales and zero points (torch): ~3 significant digits
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
    # no int4_group_size: on the CPU it defaults to 32, groups every projection of the model divides into
    eng = LLMEngine(model="dummy:tiny", device="cpu", quantization="int4", num_kv_blocks=32)
    model = eng.model
    head = model.lm_head
    assert isinstance(head, RescoredLMHead) and head.q.cpu_int4 == 32
    assert head.weight is model.model.embed_tokens.weight                 # tied: no second float table
    packs = [lin.cpu_int4_pack for layer in model.model.layers
             for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                         layer.mlp.down_proj)] + [head.q.cpu_int4_pack]
    assert all((p is None) == cpu_kernels.loaded() for p in packs)        # torch's copy only without the C++ op
    assert all(lin.cpu_int4 == 32 for layer in model.model.layers
               for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj))
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)      # lookups stay on the float table
    assert eng.weights_description == "int4 (groups of 32)"               # what the app's header says
    decode = "C++ decode layers" if cpu_kernels.loaded() else "torch decode attention"   # C++ where it was built
    assert eng.kernels_description == f"torch kernels, {decode}"
    free = eng.block_manager.num_free_blocks
    eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=6, min_tokens=6))
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert len(outs[0].token_ids) == 6 and eng.block_manager.num_free_blocks == free


def _md(n: int, bs: int = 16):
    """A prompt of n tokens in blocks 1, 2, ..., logits for every position."""
    from engine.kernels.metadata import AttentionMetadata
    return AttentionMetadata(positions=torch.arange(n), slot_mapping=torch.arange(bs, bs + n),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(1, -(-n // bs) + 1, dtype=torch.int32)[None],
                             logits_indices=torch.arange(n), q_lens=[n], seq_lens_cpu=[n], max_seqlen_q=n,
                             max_seqlen_k=n, block_size=bs)


@pytest.mark.skipif(not cpu_kernels.loaded(), reason="the C++ CPU kernels could not be built")
@torch.inference_mode()
def test_int4_engine_logits_with_the_cpp_linear_match_the_dequantized_weights(one_thread):
    """dummy:tiny's int4 model with every projection and the LM head on kvscope::int4_linear against the same
    model on its dequantized weights (F.linear): the only difference is the activations' rounding (two int8 codes,
    <= 1/32512 of a block's max a value), so the logits agree closely but not bit for bit."""
    eng = LLMEngine(model="dummy:tiny", device="cpu", quantization="int4", int4_group_size=32, num_kv_blocks=32)
    model = eng.model
    lins = [lin for layer in model.model.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                             layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    lins.append(model.lm_head.q)
    ids = torch.tensor([5, 17, 3, 99, 42, 7, 7, 250, 11, 64, 2, 31, 8])
    logits = model.compute_logits(model(ids, _md(len(ids))))               # [T, V]
    for lin in lins:
        lin.cpu_int4 = 0                                                    # QuantLinear's dequantize + F.linear
    ref = model.compute_logits(model(ids, _md(len(ids))))
    assert logits.shape == ref.shape == (len(ids), model.cfg.vocab_size)
    spread = float(ref.max() - ref.min())
    assert float((logits - ref).abs().max()) <= 1e-3 * spread
    assert not torch.equal(logits, ref)                                     # the C++ path did run


def _seq_md(starts: list[int], ends: list[int], tables: torch.Tensor, bs: int = 16):
    """Sequence i computes positions [starts[i], ends[i]) in the blocks of tables[i]; logits for each last one."""
    from engine.kernels.metadata import AttentionMetadata
    pos = torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])
    row = torch.cat([torch.full((e - s,), i) for i, (s, e) in enumerate(zip(starts, ends))])
    q_lens = [e - s for s, e in zip(starts, ends)]
    return AttentionMetadata(positions=pos, slot_mapping=tables[row, pos // bs].long() * bs + pos % bs,
                             cu_seqlens_q=torch.tensor([0, *q_lens]).cumsum(0).int(),
                             seq_lens=torch.tensor(ends, dtype=torch.int32), block_tables=tables,
                             logits_indices=torch.tensor(q_lens).cumsum(0) - 1, q_lens=q_lens, seq_lens_cpu=ends,
                             max_seqlen_q=max(q_lens), max_seqlen_k=max(ends), block_size=bs)


@pytest.mark.skipif(not cpu_kernels.loaded(), reason="the C++ CPU kernels could not be built")
@torch.inference_mode()
def test_int4_decode_step_on_the_cpp_layer_matches_the_torch_ops(one_thread):
    """A decode step of 3 sequences (contexts of 17, 33 and 5 tokens: one a block and a token) with each layer one
    kvscope::decode_layer call against the same step through the layer's torch ops, on the same caches."""
    eng = LLMEngine(model="dummy:tiny", device="cpu", quantization="int4", int4_group_size=32, num_kv_blocks=32)
    model = eng.model
    assert model.cpu_decode_layer and len(model.decode_layer_plan()) == len(model.model.layers)
    lens = [17, 33, 5]
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (sum(lens),), generator=gen)
    model(ids, _seq_md([0] * 3, lens, tables))                            # the prompts' K/V into the caches
    step = torch.randint(3, 1000, (3,), generator=gen)
    md = _seq_md(lens, [n + 1 for n in lens], tables)
    model.cpu_decode_layer = False
    ref = model(step, md)
    model.cpu_decode_layer = True
    before = model.decode_layer_steps
    out = model(step, md)
    assert model.decode_layer_steps == before + 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_kernels.loaded(), reason="the C++ CPU kernels could not be built")
def test_int4_engine_greedy_tokens_with_the_cpp_layer(one_thread):
    """Greedy tokens with decode steps on kvscope::decode_layer (cpu_decode_layer, the default) equal the layer's
    torch ops' (a batch of three, contexts crossing 16-token blocks, then one alone)."""
    prompts = [[1, 2, 3], list(range(5, 40)), list(range(7, 25))]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)

    def greedy(on: bool) -> tuple[list[list[int]], int]:
        eng = LLMEngine(model="dummy:tiny", device="cpu", quantization="int4", int4_group_size=32,
                        num_kv_blocks=32, cpu_decode_layer=on)
        out = []
        for batch in (prompts, prompts[1:2]):
            rids = [eng.add_request(p, params) for p in batch]
            done = {}
            while eng.has_unfinished_requests():
                done.update((o.request_id, list(o.token_ids)) for o in eng.step() if o.finished)
            out += [done[r] for r in rids]
        return out, eng.model.decode_layer_steps

    ref, ref_steps = greedy(False)
    out, steps = greedy(True)
    assert ref_steps == 0 and steps >= 2 * 15             # every decode step of the batch and alone
    assert out == ref


@pytest.mark.parametrize("quantization,warned", [("int8", True), ("fp8", True), ("int4", False)])
def test_cpu_engine_says_which_formats_dequantize_at_every_call(quantization, warned, caplog):
    import logging
    caplog.set_level(logging.WARNING, logger="engine.runtime.llm_engine")
    LLMEngine(model="dummy:tiny", device="cpu", quantization=quantization, num_kv_blocks=16)
    said = [r.getMessage() for r in caplog.records if "dequantized at every call" in r.getMessage()]
    assert len(said) == warned and all(m.startswith(quantization) for m in said)
