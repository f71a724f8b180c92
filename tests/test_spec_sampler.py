"""Speculative decoding is lossless in distribution: chi-square tests of the rejection sampler (synthetic p, q,
deliberately bad drafts) and of whole engine runs against the target model's exact probabilities."""
import itertools

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.spec import greedy_accept, ngram_propose, rejection_sample
from helpers import save_random_llama


pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < min_expected are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    n = counts.sum()
    exp = probs / probs.sum() * n
    small = exp < min_expected
    assert counts[probs == 0].sum() == 0, "a token with zero target probability was emitted"
    c = torch.cat([counts[~small], counts[small & (probs > 0)].sum().view(1)])
    e = torch.cat([exp[~small], exp[small & (probs > 0)].sum().view(1)])
    keep = e > 0
    c, e = c[keep], e[keep]
    stat = ((c - e) ** 2 / e).sum()
    df = max(int(keep.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _draws(p, q, n, gen, one_hot=False, accept_all=False):
    """Run the rejection sampler n times with drafts drawn from q. one_hot: the verifier is told the drafts
    were deterministic (q=None); still lossless, since given any draft x the output is distributed as p."""
    k, V = q.shape
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    counts = torch.zeros(k + 1, V)
    lengths = torch.zeros(k + 2)
    for i in range(n):
        draft = drafts[i].tolist()
        out = (draft + [int(torch.multinomial(p[k], 1, generator=gen))]) if accept_all \
            else rejection_sample(p, draft, None if one_hot else q, gen)
        lengths[len(out)] += 1
        for j, t in enumerate(out):
            counts[j, t] += 1
    return counts, lengths


def _bad_q(p, k):
    """Drafts that favour what p dislikes (mixed with a little of p so later positions are reached)."""
    bad = (1.0 / (p[:k] + 0.05)).pow(2)
    bad = bad / bad.sum(-1, keepdim=True)
    q = 0.5 * bad + 0.5 * p[:k]
    return q / q.sum(-1, keepdim=True)


def _dirichlet(n: int, V: int, seed: int) -> torch.Tensor:
    """n target distributions over V tokens, Dirichlet(0.7), from their own seed: the same whatever ran before
    (torch.distributions draws from the global generator)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Dirichlet(torch.full((V,), 0.7)).sample((n,))


@pytest.mark.parametrize("one_hot", [False, True], ids=["dense_q", "one_hot_q"])
def test_rejection_sampler_matches_target_distribution(one_hot):
    gen = torch.Generator().manual_seed(1234)
    k, V, N = (2 if one_hot else 3), 6, 5000
    p = _dirichlet(k + 1, V, seed=1234)
    p[1, int(p[1].argmax())] = 0.0                      # a token the (filtered) target never emits
    p = p / p.sum(-1, keepdim=True)
    counts, lengths = _draws(p, _bad_q(p, k), N, gen, one_hot=one_hot)
    for j in range(k + 1):
        assert counts[j].sum() > 100, f"position {j} was reached only {int(counts[j].sum())} times"
        pv = chi2_pvalue(counts[j], p[j])
        assert pv > 1e-3, f"position {j}: emitted distribution differs from p (p-value {pv:.2e})"
    assert lengths[1] > 0 and lengths[k + 1] > 0          # both early rejections and full acceptance occur


def test_chi_square_has_power():
    """The same test rejects a sampler that accepts every draft (distribution = q, not p)."""
    gen = torch.Generator().manual_seed(7)
    k, V = 2, 6
    p = _dirichlet(k + 1, V, seed=7)
    counts, _ = _draws(p, _bad_q(p, k), 2000, gen, accept_all=True)
    assert chi2_pvalue(counts[0], p[0]) < 1e-6


def test_identical_q_accepts_everything():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 10, generator=gen), -1)
    for _ in range(50):
        draft = [int(torch.multinomial(p[j], 1, generator=gen)) for j in range(3)]
        out = rejection_sample(p, draft, p[:3].clone(), gen)
        assert out[:3] == draft and len(out) == 4


def test_greedy_accept_and_ngram():
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert greedy_accept([3], []) == [3]
    toks = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert ngram_propose(toks, 1, 3, 2) == [5, 7]          # the most recent match of "1 2 3"
    assert ngram_propose(toks, 1, 3, 5) == [5, 7, 1, 2, 3]
    assert ngram_propose([1, 2, 3], 1, 3, 3) == []
    assert ngram_propose([7, 7], 1, 2, 3) == [7]           # continuation may run into the suffix itself
    assert ngram_propose([1, 2, 8, 2], 2, 3, 3) == []      # only a 1-gram matches, below ngram_min
    assert ngram_propose([1, 2, 8, 2], 1, 3, 3) == [8, 2]


# ---- whole-engine distribution test ------------------------------------------------------------
V_SMALL = 6
SMALL = dict(scale=0.5, vocab=V_SMALL, hidden=32, intermediate=64, head_dim=8, max_pos=64)


def _exact_probs(hf, prompt, temperature, top_k):
    """Exact joint probability of the first 3 generated tokens [V, V, V] under the filtered target."""
    def dist(prefixes):
        with torch.no_grad():
            lg = hf(torch.tensor(prefixes)).logits[:, -1].double() / temperature
        if top_k:
            kth = lg.topk(top_k, -1).values[:, -1:]
            lg = lg.masked_fill(lg < kth, float("-inf"))
        return lg.softmax(-1)
    p1 = dist([prompt])[0]                                            # [V]
    p2 = dist([prompt + [a] for a in range(V_SMALL)])                 # [V, V]
    pairs = list(itertools.product(range(V_SMALL), repeat=2))
    p3 = dist([prompt + [a, b] for a, b in pairs]).view(V_SMALL, V_SMALL, V_SMALL)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_engine_sampling_distribution_is_lossless(method, tmp_path):
    target = save_random_llama(tmp_path / "target", 0, 2, **SMALL)
    extra = {}
    if method == "draft":
        save_random_llama(tmp_path / "draft", 1, 1, **SMALL)      # an unrelated, bad draft model
        extra["draft_model"] = str(tmp_path / "draft")
    if method == "self":
        extra["draft_layers"] = 1
    eng = LLMEngine(model=str(tmp_path / "target"), device="cpu", block_size=4, num_kv_blocks=1200,
                    max_num_seqs=256, speculative_method=method, num_speculative_tokens=2,
                    enable_prefix_caching=True, seed=3, **extra)
    prompt = [2, 3, 2, 3, 4, 2]
    temperature, top_k = 0.9, (4 if method == "draft" else 0)
    N = 2000
    for i in range(N):
        # the first token comes from the prefill, then 2 drafts are verified (+ a bonus token);
        # the test looks at the first 3 tokens
        sp = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4, ignore_eos=True,
                            seed=(i if i % 2 else None))
        eng.add_request(prompt, sp)
    counts = torch.zeros(V_SMALL, V_SMALL, V_SMALL)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                a, b, c = out.token_ids[:3]
                counts[a, b, c] += 1
    st = eng.stats()
    assert st["spec_decode_num_draft_tokens"] > N / 2
    assert 0 < st["spec_decode_num_accepted_tokens"] < st["spec_decode_num_draft_tokens"]
    exact = _exact_probs(target, prompt, temperature, top_k)
    pv = chi2_pvalue(counts, exact)
    assert pv > 1e-3, f"{method}: engine output distribution differs from the target's (p-value {pv:.2e})"
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
