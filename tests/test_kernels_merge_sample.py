"""The one-launch Gumbel-max sampler against the torch-reduced one (same noise, so the same tokens) on random
inputs at odd sizes."""
import pytest
import torch

from engine.kernels.sampling import gumbel_sample
from kernel_helpers import DEV, GPU, rand


@pytest.mark.parametrize("B,V", [(1, 3001), (5, 2047)])
def test_gumbel_one_launch_matches_torch_reduce(B, V):
    from engine.kernels.counters import zeroed_counters
    logits = rand(B, V) * 2
    logits[0, 5] = logits[0, V - 3] = logits[0].max() + 1   # a tie across chunks: the first index wins
    temp = torch.tensor([0.0, 0.9, 0.0, 1.7, 0.4][:B], device=DEV)
    for seed in (3, 12345):
        for chunk in (None, 512):
            one = gumbel_sample(logits, temp, seed, chunk=chunk, one_launch=True)
            two = gumbel_sample(logits, temp, seed, chunk=chunk, one_launch=False)
            assert one.dtype == torch.int64 and torch.equal(one, two)
        greedy = temp <= 0
        assert torch.equal(one[greedy], logits.argmax(-1)[greedy])
        assert one[0] == 5
    assert int(zeroed_counters("gumbel_rows", DEV, 1).abs().sum()) == 0


def test_gumbel_chunk_fills_the_chip():
    from engine.kernels.sampling import _chunk_for
    assert _chunk_for(1, 128256, DEV) == (512 if GPU else 8192)   # H200 (132 SMs): 251 programs
    assert _chunk_for(1, 3001, DEV) == 512 and _chunk_for(256, 128256, DEV) == 8192


@pytest.mark.skipif(not GPU, reason="counts compiled Triton kernels")
def test_gumbel_warmup_leaves_no_compile_for_serving():
    """After the engine's warm-up, sampling any batch size up to the limit compiles nothing (a serving step
    that compiles stalls every stream for ~0.3 s)."""
    from engine.kernels.sampling import _gumbel_argmax_kernel, warmup_gumbel
    V, limit = 128256, 300
    assert warmup_gumbel(V, limit, torch.device(DEV)) > 1
    compiled = _gumbel_argmax_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    for b in (1, 2, 3, 5, 7, 9, 13, 17, 31, 64, 100, 257, limit):
        gumbel_sample(rand(b, V), torch.rand(b, device=DEV), 7)
    assert len(compiled) == before
