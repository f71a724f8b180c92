"""Simulated users with real text: chat-templated prompts from the bundled text set (inspector.load.text)."""
import pytest

from engine.models.loader import load_tokenizer, resolve
from inspector import load as L

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve("dummy:tiny")[2])          # SmolLM2's tokenizer and chat template


def test_text_prompts_are_templated_seeded_and_within_length(tok):
    spec = L.LoadSpec(num_requests=12, prompt_len=L.LengthDist("uniform", 40, 160), seed=5, prompt_source="text")
    prefix, items = L.build_workload(spec, tok.vocab_size, tokenizer=tok)
    _, again = L.build_workload(spec, tok.vocab_size, tokenizer=tok)
    assert prefix == [] and [i.new_tokens for i in items] == [i.new_tokens for i in again]
    tasks, passages = L.text_set()["tasks"], L.text_set()["passages"]
    for it in items:
        text = tok.decode(it.new_tokens)
        assert len(it.new_tokens) <= 160
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
        assert any(t[:12] in text for t in tasks)
        assert len(it.new_tokens) < 100 or any(p[:25] in text for p in passages)
    assert len({tuple(i.new_tokens) for i in items}) == len(items)


def test_text_shared_prefix_is_the_system_turn(tok):
    spec = L.LoadSpec(num_requests=6, shared_prefix_len=96, prompt_len=L.LengthDist("uniform", 30, 60),
                      num_turns=2, prompt_source="text")
    prefix, items = L.build_workload(spec, tok.vocab_size, tokenizer=tok)
    sys_text = tok.decode(prefix)
    assert 80 <= len(prefix) <= 96 and sys_text.startswith("<|im_start|>system\nYou are a helpful assistant")
    for it in items:
        text = tok.decode(it.new_tokens)
        assert text.startswith("<|im_start|>user\n") and "system" not in text[:20]
        assert len(it.new_tokens) <= 60
    spec.validate(512)


def test_text_needs_a_chat_template(tok):
    spec = L.LoadSpec(num_requests=2, prompt_source="text")
    with pytest.raises(ValueError, match="prompts: 'text' needs"):
        L.build_workload(spec, 5000, tokenizer=None)
    with pytest.raises(ValueError, match="prompts: must be one of"):
        L.LoadSpec(prompt_source="words").validate()
    info = L.EngineInfo(chat_template=False)
    assert L.preset("Shared system prompt (prefix caching)", info).prompt_source == "random ids"
    assert L.preset("Real text (speculative decoding)").prompt_source == "text"
