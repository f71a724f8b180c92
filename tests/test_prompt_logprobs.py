"""Prompt logprobs come from the prefill's own forward: each prompt position's top-n equal the first output
logprobs of a request whose prompt ends there, across chunked-prefill boundaries, with prefix caching on and
a warm cache (a prompt-logprobs request takes no cached prefix)."""
import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16,
               enable_prefix_caching=True)


def test_prompt_logprobs_match_a_reference_per_position(llm):
    check_against_reference(llm, abs_tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prompt_logprobs_on_cuda_with_graphs():
    llm = LLM("dummy:tiny", device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=16, enable_prefix_caching=True)
    check_against_reference(llm, abs_tol=2e-3)


def check_against_reference(llm, abs_tol):
    prompt = list(range(3, 43))                            # 40 tokens: three 16-token chunks
    warm = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]   # caches the prefix blocks
    a, b = llm.generate([prompt, prompt], [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3),
                                           SamplingParams(max_tokens=1, temperature=0)])
    assert warm.token_ids == b.token_ids
    pl = a.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None and a.num_cached_tokens == 0
    assert all(e[0].token_id == t and 1 <= e[0].rank for e, t in zip(pl[1:], prompt[1:]))
    for k in (1, 15, 16, 17, 33, 39):                      # chunk edges included
        ref = llm.generate([prompt[:k]], SamplingParams(max_tokens=1, temperature=0, logprobs=3))[0].logprobs[0]
        assert [x.token_id for x in pl[k][1:]] == [x.token_id for x in ref[1:]]
        assert [x.logprob for x in pl[k][1:]] == pytest.approx([x.logprob for x in ref[1:]], abs=abs_tol)
        assert [x.rank for x in pl[k][1:]] == [1, 2, 3]


def test_prompt_logprobs_range_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
