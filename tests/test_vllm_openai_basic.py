"""Ported from vLLM's tests/entrypoints/openai: basic/test_basic.py (version, health, content type),
test_tokenization.py (/tokenize, /detokenize, /tokenizer_info), basic/test_return_token_ids.py,
chat_completion/test_chat_logit_bias_validation.py, and the models endpoint.

Adaptations, common to every test (each test notes its own):
- vLLM's async client + pytest-asyncio (and `requests`) -> the sync official `openai` client and httpx.
- zephyr-7b-beta / Qwen2.5 / tiny-random-Llama -> `dummy:tiny` (random weights, SmolLM2's tokenizer and
  chat template); max_model_len 8192 -> the fixture's 1024; the tokenizer is the server's own.
- vLLM's `--enable-tokenizer-info-endpoint` switch: kvscope serves /tokenizer_info always.
"""
import httpx
import openai
import pytest

from engine.entrypoints.openai.serving_tokenization import version
import vllm_openai_server
from vllm_openai_server import MAX_MODEL_LEN, MODEL_NAME

server, client = vllm_openai_server.server, vllm_openai_server.client   # fixtures: one server for this file

pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture(scope="module")
def tokenizer(server):
    return server.tokenizer


# ------------------------------------------------------------------------------ basic/test_basic.py
def test_show_version(server):
    response = httpx.get(server.url_for("version"))
    response.raise_for_status()
    assert response.json() == {"version": version()}        # adaptation: kvscope's version, not vLLM's


def test_check_health(server):
    assert httpx.get(server.url_for("health")).status_code == 200


def test_request_wrong_content_type(client):
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(messages=[{"role": "user", "content": "Write a long story"}],
                                       model=MODEL_NAME, max_tokens=10000,
                                       extra_headers={"Content-Type": "application/x-www-form-urlencoded"})


def test_models(client):
    # adaptation: vLLM's models endpoint test lists base model + LoRAs; kvscope serves the one model
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].object == "model" and models[0].owned_by


# ------------------------------------------------------------------------------ test_tokenization.py
def test_tokenize_completions(server, tokenizer):
    for add_special in [False, True]:
        prompt = "vllm1 This is a test prompt."
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        response = httpx.post(server.url_for("tokenize"),
                              json={"add_special_tokens": add_special, "model": MODEL_NAME, "prompt": prompt})
        response.raise_for_status()
        result = response.json()
        assert result["tokens"] == tokens
        assert result["count"] == len(tokens)
        assert result["max_model_len"] == MAX_MODEL_LEN
        # adaptation: vLLM sends "token_strs": null; kvscope leaves the field out unless asked for
        assert result.get("token_strs") is None


@pytest.mark.parametrize("with_tools", [False, True], ids=["chat", "chat_with_tools"])
def test_tokenize_chat(server, tokenizer, with_tools):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}]
    for add_generation in [False, True]:
        for add_special in [False, True]:
            conversation = [{"role": "user", "content": "Hi there!"},
                            {"role": "assistant", "content": "Nice to meet you!"},
                            {"role": "user", "content": "Can I ask a question? vllm1"}]
            for continue_final in [False, True]:
                if add_generation and continue_final:
                    continue
                if continue_final:
                    conversation.append({"role": "assistant", "content": "Sure,"})
                body = {"add_generation_prompt": add_generation, "continue_final_message": continue_final,
                        "add_special_tokens": add_special, "messages": conversation, "model": MODEL_NAME}
                if with_tools:
                    body["tools"] = tools
                response = httpx.post(server.url_for("tokenize"), json=body)
                response.raise_for_status()
                result = response.json()
                if not with_tools:
                    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation,
                                                           continue_final_message=continue_final, tokenize=False)
                    tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
                    assert result["tokens"] == tokens
                else:
                    # adaptation: SmolLM2's template renders no tools, so kvscope puts them in a system prompt
                    # (docs/api.md); vLLM compares with the template's own rendering of `tools`
                    text = tokenizer.decode(result["tokens"])
                    assert '"get_weather"' in text and "Can I ask a question? vllm1" in text
                assert result["count"] == len(result["tokens"])
                assert result["max_model_len"] == MAX_MODEL_LEN
                assert result.get("token_strs") is None


def test_tokenize_with_return_token_strs(server, tokenizer):
    prompt = "This is a token_strs test prompt! vllm1"
    response = httpx.post(server.url_for("tokenize"),
                          json={"prompt": prompt, "model": MODEL_NAME, "return_token_strs": True})
    response.raise_for_status()
    tokens = tokenizer.encode(prompt, add_special_tokens=True)
    result = response.json()
    assert result["tokens"] == tokens
    assert result["count"] == len(tokens)
    assert result["max_model_len"] == MAX_MODEL_LEN
    assert result["token_strs"] == tokenizer.convert_ids_to_tokens(tokens)


def test_detokenize(server, tokenizer):
    prompt = "This is a test prompt. vllm1"
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    response = httpx.post(server.url_for("detokenize"), json={"model": MODEL_NAME, "tokens": tokens})
    response.raise_for_status()
    assert response.json() == {"prompt": prompt}


def test_tokenizer_info_basic(server):
    response = httpx.get(server.url_for("tokenizer_info"))
    response.raise_for_status()
    result = response.json()
    assert "tokenizer_class" in result
    assert isinstance(result["tokenizer_class"], str) and result["tokenizer_class"]


def test_tokenizer_info_schema(server):
    result = httpx.get(server.url_for("tokenizer_info")).json()
    field_types = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool,
                   "split_special_tokens": bool, "bos_token": str, "eos_token": str, "pad_token": str,
                   "unk_token": str, "chat_template": str, "errors": str, "model_max_length": int,
                   "additional_special_tokens": list, "added_tokens_decoder": dict}
    for field, expected_type in field_types.items():
        if field in result and result[field] is not None:
            assert isinstance(result[field], expected_type), f"{field} should be {expected_type.__name__}"


def test_tokenizer_info_added_tokens_structure(server):
    added_tokens = httpx.get(server.url_for("tokenizer_info")).json().get("added_tokens_decoder")
    for token_id, token_info in (added_tokens or {}).items():
        assert isinstance(token_id, str) and isinstance(token_info, dict)
        assert "content" in token_info and isinstance(token_info["special"], bool)


def test_tokenizer_info_consistency_with_tokenize(server):
    info = httpx.get(server.url_for("tokenizer_info")).json()
    tokenize_result = httpx.post(server.url_for("tokenize"), json={"model": MODEL_NAME, "prompt": "Hello world!"}
                                 ).json()
    info_max_len, tokenize_max_len = info.get("model_max_length"), tokenize_result.get("max_model_len")
    if info_max_len and tokenize_max_len:
        assert info_max_len >= tokenize_max_len


def test_tokenizer_info_chat_template(server):
    chat_template = httpx.get(server.url_for("tokenizer_info")).json().get("chat_template")
    if chat_template:
        assert isinstance(chat_template, str) and chat_template.strip()


# ------------------------------------------------------------------------------ basic/test_return_token_ids.py
EMOJI_PROMPT = "Complete this sentence with emojis: I love coding 🚀"


def test_basic_completion_with_emoji(client, tokenizer):
    completion = client.completions.create(model=MODEL_NAME, prompt=EMOJI_PROMPT, max_tokens=10, temperature=0,
                                           logprobs=1, extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    assert isinstance(choice.prompt_token_ids, list)
    encoded_tokens = tokenizer.encode(EMOJI_PROMPT)
    ids = choice.prompt_token_ids
    assert any(ids[i:i + len(encoded_tokens)] == encoded_tokens for i in range(len(ids) - len(encoded_tokens) + 1))
    assert isinstance(choice.token_ids, list) and len(choice.token_ids) > 0
    assert tokenizer.decode(choice.token_ids).startswith(choice.text)

    without = client.completions.create(model=MODEL_NAME, prompt=EMOJI_PROMPT, max_tokens=10, temperature=0,
                                        logprobs=1, extra_body={"return_token_ids": False}).model_dump()
    assert without["choices"][0].get("token_ids") is None
    assert without.get("prompt_token_ids") is None


def test_chat_completion_with_tool_use(client, tokenizer):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a given location",
        "parameters": {"type": "object", "required": ["location"], "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}]
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What's the weather like in Paris?"}]
    # adaptation: max_tokens 100 -> 10, and ignore_eos so the random model writes some text
    kw = dict(model=MODEL_NAME, messages=messages, tools=tools, tool_choice="auto", max_tokens=10, temperature=0,
              logprobs=True)
    response = client.chat.completions.create(**kw, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert isinstance(response.choices[0].token_ids, list)
    assert isinstance(response.prompt_token_ids, list)
    prompt_text = tokenizer.decode(response.prompt_token_ids)
    assert "You are a helpful assistant" in prompt_text
    assert "What's the weather like in Paris?" in prompt_text
    assert len(tokenizer.decode(response.choices[0].token_ids)) > 0
    assert response.choices[0].message.content is not None
    if response.choices[0].message.tool_calls:
        assert response.choices[0].message.tool_calls[0].function.name == "get_weather"

    without = client.chat.completions.create(**kw, extra_body={"return_token_ids": False})
    assert getattr(without.choices[0], "token_ids", None) is None
    assert getattr(without, "prompt_token_ids", None) is None


def test_comparison_with_prompt_logprobs_and_logprobs(client, tokenizer):
    # adaptation: max_tokens 20/30 -> 8
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Hello, world! How are you today?", max_tokens=8, temperature=0, echo=True,
        logprobs=1, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1,
                                "ignore_eos": True})
    choice = completion.choices[0]
    assert choice.token_ids is not None and choice.prompt_token_ids is not None
    assert choice.prompt_logprobs is not None and choice.logprobs is not None
    logprobs_token_ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens
                          if t.startswith("token_id:")]
    # with echo the logprobs cover the prompt and the completion; token_ids is the completion's suffix
    assert len(choice.token_ids) < len(logprobs_token_ids)
    assert logprobs_token_ids[-len(choice.token_ids):] == choice.token_ids
    assert "Hello, world" in tokenizer.decode(choice.prompt_token_ids)
    assert choice.text.endswith(tokenizer.decode(choice.token_ids))

    stream = client.completions.create(
        model=MODEL_NAME, prompt="Tell me a short fact about Python:", max_tokens=8, temperature=0, stream=True,
        echo=False, logprobs=1, extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    streamed_prompt_token_ids, streamed_token_ids, streamed_logprob_token_ids = None, [], []
    for chunk in stream:
        # adaptation: a finishing chunk of its own has no logprobs / token_ids
        lp = chunk.choices[0].logprobs
        streamed_logprob_token_ids += [int(t.removeprefix("token_id:")) for t in (lp.tokens if lp else [])
                                       if t.startswith("token_id:")]
        if streamed_prompt_token_ids is None:
            streamed_prompt_token_ids = chunk.choices[0].prompt_token_ids
        streamed_token_ids += getattr(chunk.choices[0], "token_ids", None) or []
    assert len(streamed_prompt_token_ids) > 0
    assert streamed_token_ids == streamed_logprob_token_ids and streamed_token_ids


def test_chat_completion_with_emoji_and_token_ids(client, tokenizer):
    chat_messages = [{"role": "system", "content": "You like to use emojis in your responses."},
                     {"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    # adaptation: max_tokens 50 -> 10, ignore_eos so the random model writes some text
    kw = dict(model=MODEL_NAME, messages=chat_messages, max_tokens=10, temperature=0)
    response = client.chat.completions.create(**kw, logprobs=True,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
    assert response.choices[0].token_ids is not None
    assert "prompt_token_ids" in response.model_dump()
    decoded_prompt = tokenizer.decode(response.prompt_token_ids)
    assert "You like to use emojis in your responses" in decoded_prompt
    assert "I love cats 🐱" in decoded_prompt
    assert len(tokenizer.decode(response.choices[0].token_ids)) > 0

    collected_content, collected_token_ids, first_chunk = "", [], True
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}):
        if first_chunk:
            assert isinstance(chunk.prompt_token_ids, list)
            assert tokenizer.decode(chunk.prompt_token_ids) == decoded_prompt
            first_chunk = False
        else:
            assert (chunk.model_extra or {}).get("prompt_token_ids") is None, \
                "Subsequent chunks should not have prompt_token_ids"
        if chunk.choices:
            collected_content += chunk.choices[0].delta.content or ""
            collected_token_ids += getattr(chunk.choices[0], "token_ids", None) or []
    assert len(collected_content) > 0 and len(collected_token_ids) > 0
    assert len(tokenizer.decode(collected_token_ids)) > 0


# ------------------------------------------------------------------------------ test_chat_logit_bias_validation.py
def _vocab_size(server):
    # adaptation: vLLM reads ModelConfig.get_vocab_size(); kvscope's /tokenizer_info reports the model's
    return httpx.get(server.url_for("tokenizer_info")).json()["vocab_size"]


def test_chat_logit_bias_valid(client, server):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Testing valid logit bias"}], max_tokens=5,
        logit_bias={str(_vocab_size(server) - 1): 1.0})
    assert completion.choices[0].message.content is not None


def test_chat_logit_bias_invalid(client, server):
    vocab_size = _vocab_size(server)
    invalid_token_id = vocab_size + 1
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Testing"}],
                                       max_tokens=5, logit_bias={str(invalid_token_id): 1.0})
    assert excinfo.value.status_code == 400
    assert str(invalid_token_id) in str(excinfo.value)
    assert str(vocab_size) in str(excinfo.value)


def test_chat_logit_bias_non_integer_key(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Testing"}],
                                       max_tokens=5, logit_bias={"not_a_token_id": 50})
    assert excinfo.value.status_code == 400
    assert "not_a_token_id" in str(excinfo.value) and "logit_bias" in str(excinfo.value)


def test_chat_logit_bias_non_numeric_value(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Testing"}],
                                       max_tokens=5, logit_bias={"1": "not_a_number"})
    assert excinfo.value.status_code == 400
    assert "logit_bias" in str(excinfo.value)


def test_chat_logit_bias_multiple_non_integer_keys(client):
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Testing"}],
                                       max_tokens=5, logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert excinfo.value.status_code == 400
    assert "bad1" in str(excinfo.value) and "bad2" in str(excinfo.value)


def test_continue_final_message_validation(server):
    # not from vLLM's tests: the 400s vLLM's ChatCompletionRequest validator gives for continue_final_message
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure,"}]
    for body in ({"messages": msgs, "continue_final_message": True},          # add_generation_prompt defaults true
                 {"messages": msgs[:1], "continue_final_message": True, "add_generation_prompt": False}):
        r = httpx.post(server.url_for("v1/chat/completions"), json={**body, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
