"""A stand-in for vLLM's `RemoteOpenAIServer` (tests/utils.py) for the tests ported from vLLM's
tests/entrypoints/openai: kvscope's OpenAI server on `dummy:tiny`, served by uvicorn on a free port in this
process (one per test module), reached over real HTTP with the official `openai` client."""
from __future__ import annotations

import openai
import pytest

from engine import EngineConfig
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.runtime.async_engine import EngineLoop

MODEL_NAME = "dummy:tiny"
MAX_MODEL_LEN = 1024


class RemoteOpenAIServer:
    def __init__(self, model: str = MODEL_NAME, **config):
        kw = dict(model=model, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
        self.loop = EngineLoop(EngineConfig(**{**kw, **config}))
        self.thread = None

    def __enter__(self) -> "RemoteOpenAIServer":
        self.loop.start()
        self.thread = ServerThread(build_app(self.loop)).start()
        self.url = self.thread.url
        return self

    def __exit__(self, *exc) -> None:
        self.thread.stop()
        self.loop.shutdown()

    @property
    def tokenizer(self):
        return self.loop.engine.tokenizer

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url, *parts])

    def get_client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="token-abc123", max_retries=0,
                             **{"timeout": 120, **kw})


# one server per test module that imports these fixtures (module scope: each importing module gets its own)
@pytest.fixture(scope="module")
def server():
    with RemoteOpenAIServer() as remote_server:
        yield remote_server


@pytest.fixture(scope="module")
def client(server):
    return server.get_client()


def assert_usage_after_finish(stream) -> None:
    """include_usage without continuous stats: no chunk carries usage until the one after the finishing chunk."""
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            assert_usage_chunk(next(stream))


def assert_usage_chunk(chunk) -> None:
    """The chunk that follows the finishing one under stream_options.include_usage: usage only, adding up."""
    assert chunk.usage is not None
    assert chunk.usage.prompt_tokens > 0
    assert chunk.usage.completion_tokens > 0
    assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert chunk.choices == []

