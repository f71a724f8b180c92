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
