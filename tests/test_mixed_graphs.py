"""Mixed steps (prefill chunks beside decodes) in CUDA graphs, checked on CPU: the Triton attention launch that
a mixed graph bakes in (sizes from tensor shapes only, padding tokens as an extra sequence, empty slots) against
the reference, and the graph runner's padded static-buffer forward run eagerly (capture=False) against plain
steps: greedy output identical with staggered arrivals, chunked prefill and preemption."""
import random

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.worker.cuda_graphs import MIXED, CudaGraphRunner, mixed_token_sizes
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.paged_attention import paged_attention
from engine.kernels.paged_attention_ref import paged_attention_ref
from helpers import SPEC_VOCAB, check_no_leak
from kernel_helpers import DEV

pytestmark = pytest.mark.usefixtures("one_thread")


def _md(q_lens, seq_lens, tables, bs, **kw):
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    i64 = dict(dtype=torch.int64, device=DEV)
    return AttentionMetadata(
        positions=torch.zeros(sum(q_lens), **i64), slot_mapping=torch.zeros(sum(q_lens), **i64),
        cu_seqlens_q=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=tables.to(DEV),
        logits_indices=torch.zeros(0, **i64), q_lens=list(q_lens), seq_lens_cpu=list(seq_lens),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens), block_size=bs, **kw)


@pytest.mark.parametrize("splits", [1, 4])
def test_graphed_mixed_attention_matches_reference(splits):
    """Decodes, prefill chunks with context, a 1-token chunk; padded to Tp tokens over 9 slots (odd sizes: G = 3,
    D = 24)."""
    g = torch.Generator().manual_seed(0)
    H, Hk, D, bs, nblocks = 6, 2, 24, 4, 40
    q_lens, seq_lens = [1, 7, 1, 5, 1, 3], [9, 7, 1, 13, 22, 3]
    T, B, P = sum(q_lens), len(q_lens), 9
    Tp = T + 5
    kc = torch.randn(nblocks, bs, Hk, D, generator=g)
    vc = torch.randn(nblocks, bs, Hk, D, generator=g)
    width = -(-max(seq_lens) // bs)
    perm = torch.randperm(nblocks - 1, generator=g) + 1                    # block 0 is the null block
    tables = torch.zeros(B, width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        k = -(-n // bs)
        tables[i, :k] = perm[used:used + k]
        used += k
    q = torch.randn(Tp, H, D, generator=g)
    q, kc, vc = q.to(DEV), kc.to(DEV), vc.to(DEV)
    ref = paged_attention_ref(q[:T].double(), kc.double(), vc.double(), _md(q_lens, seq_lens, tables, bs), D ** -0.5)
    # the graph's layout: sequence B owns the padding tokens (context in the null block), slots past it are empty
    pad = Tp - T
    big = torch.full((P, width + 3), 7, dtype=torch.int32)                 # stale rows past each length
    big[:B, :width] = tables
    big[B, :-(-pad // bs)] = 0
    md = _md(q_lens + [pad] + [0] * (P - B - 1), seq_lens + [pad] + [0] * (P - B - 1), big, bs, mixed_splits=splits)
    out = paged_attention(q, kc, vc, md, D ** -0.5)
    torch.testing.assert_close(out[:T].double(), ref, atol=2e-4, rtol=2e-4)


def test_mixed_token_sizes():
    sizes = mixed_token_sizes(2048)
    assert sizes[0] == 16 and sizes[-1] == 2048 and sizes == sorted(set(sizes))
    assert all(b - a <= max(16, a // 4) for a, b in zip(sizes, sizes[1:]))   # padding waste stays bounded
    assert mixed_token_sizes(100)[-2:] == [96, 100]


def _run(target, kernels, num_kv_blocks, graphs, n_reqs, max_tokens=48):
    eng = LLMEngine(model=target, device="cpu", dtype="float32", block_size=4, max_model_len=56, kernels=kernels,
                    num_kv_blocks=num_kv_blocks, max_num_batched_tokens=max_tokens, max_num_seqs=6)
    keys = []
    if graphs:
        g = CudaGraphRunner(eng.runner, eng.config, capture=False)
        run_mixed = g._run_mixed
        g._run_mixed = lambda key, ids, md: (keys.append((key, md.q_lens)), run_mixed(key, ids, md))[1]
        eng.runner.graphs = g
    rng = random.Random(3)
    reqs = [([rng.randrange(2, SPEC_VOCAB) for _ in range(rng.randrange(3, 40))], rng.randrange(4, 16))
            for _ in range(n_reqs)]
    outs, step = {}, 0
    while reqs or eng.has_unfinished_requests():
        if reqs and step % 3 == 0:                         # staggered: newcomers join running decodes
            prompt, n = reqs.pop(0)
            eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                            request_id=f"r{step:03d}")
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        step += 1
    check_no_leak(eng)
    return [outs[k] for k in sorted(outs)], keys, eng.stats()


@pytest.mark.parametrize("blocks", [200, 16], ids=["roomy", "preemption"])
def test_mixed_graph_layout_is_lossless(spec_models, blocks):
    """Torch kernels (the Triton launch is checked above; under the interpreter an engine run takes minutes,
    and tests/test_gpu_engine.py runs it compiled)."""
    kernels, n_reqs = "torch", 8
    target = spec_models["target"]
    ref, _, _ = _run(target, kernels, blocks, graphs=False, n_reqs=n_reqs)
    got, keys, st = _run(target, kernels, blocks, graphs=True, n_reqs=n_reqs)
    assert got == ref
    mixed = [(key, q) for key, q in keys if key[1] == MIXED]
    assert any(1 in q and max(q) > 1 for _, q in mixed)              # prefill chunks beside decodes
    assert any(key[0] > sum(q) for key, q in mixed)                 # padded to a bucket
    if blocks < 50:
        assert st["num_preemptions_total"] > 0
