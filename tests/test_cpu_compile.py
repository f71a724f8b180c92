"""Compiled CPU decode steps (engine/worker/cpu_compile.py): the tensor-only decode attention, the padded layout,
and the compiled graphs against the eager path."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import torch_ops
from engine.kernels.metadata import AttentionMetadata
from engine.worker.cpu_compile import CompiledDecode, compile_sizes

pytestmark = pytest.mark.usefixtures("one_thread")

# three prompt lengths: a batch of 3 pads to 4, rows of different lengths mask, contexts cross 16-token blocks
PROMPTS = [[1, 2, 3], list(range(5, 40)), list(range(7, 25))]


def greedy(llm: LLM, prompts=PROMPTS, n: int = 24) -> list[list[int]]:
    p = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    return [list(o.token_ids) for o in llm.generate(prompts, p, use_tqdm=False)]


def test_compile_sizes():
    assert compile_sizes(1) == [1]
    assert compile_sizes(8) == [1, 2, 4, 8]
    assert compile_sizes(6) == [1, 2, 4, 8]


def test_config_rejects_bad_max_batch():
    with pytest.raises(ValueError, match="cpu_compile_max_batch"):
        LLM(model="dummy:tiny", device="cpu", cpu_compile_max_batch=0)


def test_decode_attention_op_matches_paged_attention():
    """The opaque op (KV store + attention, lengths read from tensors) against the eager paged attention."""
    torch.manual_seed(0)
    N, bs, Hk, D, H = 12, 4, 2, 8, 6
    lens = [5, 9, 1]
    B = len(lens)
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 0, 0]], dtype=torch.int32)
    caches = [torch.randn(N, bs, Hk, D) for _ in range(2)]
    q, k, v = torch.randn(B, H, D), torch.randn(B, Hk, D), torch.randn(B, Hk, D)
    pos = torch.tensor(lens) - 1
    slots = tables[torch.arange(B), pos // bs].long() * bs + pos % bs
    md = AttentionMetadata(positions=pos, slot_mapping=slots, cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32),
                           seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                           logits_indices=torch.arange(B), q_lens=[1] * B, seq_lens_cpu=lens, max_seqlen_q=1,
                           max_seqlen_k=max(lens), block_size=bs)
    kc, vc = (c.clone() for c in caches)
    torch_ops.store_kvcache(k, v, kc, vc, slots)
    ref = torch_ops.paged_attention(q, kc, vc, md, 0.3)
    kc2, vc2 = (c.clone() for c in caches)
    wide = torch.zeros(B, 8, dtype=torch.int32)            # the compiled step's full-width tables
    wide[:, :3] = tables
    out = torch.ops.kvscope.decode_attention(q, k, v, kc2, vc2, slots, wide, md.seq_lens, 0.3)
    torch.testing.assert_close(out, ref)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_padded_tensor_only_forward_matches_eager():
    """The compiled step's padded, tensor-only forward, run eagerly, gives the eager engine's greedy tokens."""
    ref = greedy(LLM(model="dummy:tiny", device="cpu"))
    llm = LLM(model="dummy:tiny", device="cpu")
    runner = llm.engine.runner
    runner.compiled = CompiledDecode(runner, llm.engine.config, compile=False)
    assert greedy(llm) == ref
    assert runner.compiled.steps >= 23                  # every decode step of the batch (of 3, padded to 4) and alone


@pytest.mark.slow
def test_compiled_decode_matches_eager():
    """TorchInductor graphs for batch 1, 2 and 4 (compiled at engine start), int4 weights (the GEMMs extern calls
    inside the graph, the rest fused; the fp32 layout is the padded forward above): the eager path's greedy
    tokens, and no compile after the start across context lengths and batch sizes."""
    from torch._dynamo.utils import counters
    extra = {"quantization": "int4", "int4_group_size": 32}
    ref = greedy(LLM(model="dummy:tiny", device="cpu", **extra))
    llm = LLM(model="dummy:tiny", device="cpu", cpu_compile=True, cpu_compile_max_batch=4, **extra)
    compiled = llm.engine.runner.compiled
    assert sorted(compiled.compile_s) == [1, 2, 4]
    graphs = counters["stats"]["unique_graphs"]
    assert greedy(llm) == ref
    assert greedy(llm, [PROMPTS[1]]) == [ref[1]]
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.steps >= 23 + 23
