"""logit_bias: +100 makes a greedy request emit the token, -100 bans it, each request of a batch gets its own
biases (sampler, engine and HTTP); biases out of range or off the vocabulary are refused."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import SampleRow, sample


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_sampler_batched_biases_greedy_and_sampled(device):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)).to(device)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={7: 100}),            # forces token 7
              SamplingParams(temperature=0, logit_bias={top[1]: -100}),      # bans row 1's argmax
              SamplingParams(temperature=0),                                  # untouched
              SamplingParams(temperature=1.0, logit_bias={t: -100 for t in range(50) if t != 11})]  # only 11 left
    toks, _ = sample(logits.clone(), [SampleRow(p, [], 0, 0) for p in params],
                     torch.Generator(device=device).manual_seed(1))
    second = logits[1].clone()
    second[top[1]] = float("-inf")
    assert toks == [7, int(second.argmax()), top[2], 11]


def test_bias_range_checked():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1})


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", device="cpu", num_kv_blocks=64, max_model_len=128)


def test_engine_batch_each_request_its_own_bias(llm):
    check_batch(llm)


@CUDA
def test_engine_batch_biases_on_cuda_with_graphs_and_multi_step():
    check_batch(LLM("dummy:tiny", device="cuda", num_kv_blocks=64, max_model_len=128, enable_cuda_graphs=True,
                    num_scheduler_steps=8))


def check_batch(llm):
    prompt = [5, 6, 7, 8]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    banned = plain[0]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={42: 100}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={banned: -100}),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={43: 100})]
    outs = [o.token_ids for o in llm.generate([prompt] * 4, params)]
    assert outs[0] == [42] * 6
    assert banned not in outs[1] and outs[1] != plain
    assert outs[2] == plain
    assert outs[3] == [43] * 6            # +100 outweighs any logit of this model at temperature 1


def test_engine_rejects_bias_off_vocabulary(llm):
    V = llm.engine.arch_config.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias: token id .* outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={V: 1.0}))
    with pytest.raises(ValueError, match=r"stop_token_ids: must be token ids in \[0, "):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[V + 5]))
