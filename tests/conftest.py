import os

# The Triton interpreter must be chosen before any @triton.jit function is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def smollm2_engine_factory():
    """Build engines on the bundled SmolLM2 (fp32, CPU); each call gets a fresh engine."""
    from engine import LLMEngine

    def make(**cfg):
        cfg.setdefault("device", "cpu")
        cfg.setdefault("cpu_kv_cache_gib", 0.25)
        return LLMEngine(model=None, **cfg)
    return make
