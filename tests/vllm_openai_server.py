"""A stand-in for vLLM's `RemoteOpenAIServer` (tests/utils.py) for the tests ported from vLLM's
tests/entrypoints/openai: kvscope's OpenAI server on `dummy:tiny`, served by uvicorn on a free port in this
process (one per test module), reached over real HTTP with the official `openai` client."""
from __future__ import annotations

import openai

from engine import EngineConfig
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.runtime.async_engine import EngineLoop

MODEL_NAME = "dummy:tiny"


class RemoteOpenAIServer:
    def __init__(self, model: str = MODEL_NAME, **config):
        kw = dict(model=model, device="cpu", num_kv_blocks=256, block_size=16, max_model_len=1024, max_num_seqs=8)
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
