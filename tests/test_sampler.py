"""Sampler: the distribution it draws from is the filtered, tempered softmax."""
import torch
from scipy import stats

from engine.sample.sampler import SampleRow, filtered_probs, sample
from engine.sampling_params import SamplingParams


def rows(n, **kw):
    return [SampleRow(SamplingParams(**kw), [], 0, i) for i in range(n)]


def draw(logits, params, n=4000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = logits.expand(n, -1).clone()
    toks, _ = sample(batch, [SampleRow(params, [], 0, 0)] * n, gen)
    return torch.bincount(torch.tensor(toks), minlength=logits.shape[-1])


def test_unfiltered_matches_softmax_chi_square():
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(3)) * 2
    counts = draw(logits, SamplingParams(temperature=0.7))
    probs = (logits / 0.7).softmax(-1)[0]
    keep = probs * counts.sum() > 5                     # chi-square needs expected counts >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]]).double()
    exp = torch.cat([probs[keep], probs[~keep].sum()[None]]).double() * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p = stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert p > 1e-3


def test_top_k_top_p_min_p_masks():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    assert set(draw(logits, SamplingParams(top_k=2)).nonzero().flatten().tolist()) == {0, 1}
    probs = logits.softmax(-1)[0]
    # top_p=0.8: smallest prefix with mass >= 0.8
    cut = int((probs.cumsum(0) < 0.8).sum()) + 1
    assert set(draw(logits, SamplingParams(top_p=0.8)).nonzero().flatten().tolist()) == set(range(cut))
    # min_p=0.2: tokens with p >= 0.2 * p_max
    allowed = set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())
    assert set(draw(logits, SamplingParams(min_p=0.2)).nonzero().flatten().tolist()) == allowed
    filt = filtered_probs(logits, rows(1, top_k=3, top_p=1.0))
    torch.testing.assert_close(filt[0, :3], logits[0, :3].softmax(-1))


def test_greedy_and_seeded_reproducible():
    logits = torch.randn(3, 50)
    toks, _ = sample(logits.clone(), rows(3, temperature=0))
    assert toks == logits.argmax(-1).tolist()
    a, _ = sample(logits.clone(), rows(3, temperature=1.0, seed=42))
    b, _ = sample(logits.clone(), rows(3, temperature=1.0, seed=42))
    assert a == b


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    p = SamplingParams(temperature=0, repetition_penalty=4.0)
    toks, _ = sample(logits.clone(), [SampleRow(p, [0, 1], 0, 0)])
    assert toks == [2]            # token 0 (2.0 -> 0.5) falls below token 2 (1.0)
    p = SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.6)
    toks, _ = sample(logits.clone(), [SampleRow(p, [9, 0, 0], 1, 0)])   # prompt [9], output [0, 0]
    assert toks == [2]            # 2.0 - 2*1.0 - 0.6 = -0.6
