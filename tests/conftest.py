import os

# The Triton interpreter must be chosen before any @triton.jit function is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)        # one pytest-xdist process per core: each runs its torch ops on its own core


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a test that takes more than a few seconds on a 2-core CPU (a real model, many engines, "
                   "a browser, a soak); `python -m pytest -q -m \"not slow\" tests` runs the rest in a few minutes")
    config.addinivalue_line(
        "markers", "spread: under pytest-xdist's `--dist loadgroup` this test's cases go to any worker; every other "
                   "test runs with the rest of its file in one worker (engines that size their KV pool from free GPU "
                   "memory must not start side by side)")


def pytest_sessionstart(session):
    """The C++ CPU kernels built (once per machine) and loaded before any engine starts: every test's
    engine then runs the same kernels, whenever a build would have finished in the background."""
    from engine.kernels import cpu_kernels
    cpu_kernels.load()


def pytest_collection_modifyitems(config, items):
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("spread") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest single-threaded, and a shared 2-core box punishes oversubscription (use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def smollm2_engine_factory():
    """Build engines on the bundled SmolLM2 (fp32, CPU); each call gets a fresh engine."""
    from engine import LLMEngine

    def make(**cfg):
        cfg.setdefault("device", "cpu")
        cfg.setdefault("cpu_kv_cache_gib", 0.25)
        return LLMEngine(model=None, **cfg)
    return make


@pytest.fixture(scope="session")
def spec_models(tmp_path_factory):
    """HF folders of random-weight models for speculative decoding: a 4-layer target and an unrelated 2-layer
    draft (mostly rejected drafts), vocabulary helpers.SPEC_VOCAB."""
    from helpers import SPEC_VOCAB, save_random_llama
    root = tmp_path_factory.mktemp("spec_models")
    save_random_llama(root / "target", 0, 4, vocab=SPEC_VOCAB)
    save_random_llama(root / "draft", 1, 2, vocab=SPEC_VOCAB)
    return {"target": str(root / "target"), "draft": str(root / "draft")}


@pytest.fixture(scope="session")
def engine_run():
    """Events of a real `dummy:tiny` CPU engine on a small workload (helpers.record_engine_run): 24 greedy requests
    with a shared one-block prefix, arriving over time, on a 16-block pool that preempts."""
    from helpers import record_engine_run
    return record_engine_run()


@pytest.fixture(scope="session")
def spec_engine_run():
    """The same kind of workload with speculative decoding (the model's first layer drafts 3 tokens, sampled at
    temperature 1 with per-request seeds, so some drafts are rejected) on a pool large enough not to preempt."""
    from helpers import record_engine_run
    return record_engine_run(num_requests=12, seed=1, num_kv_blocks=40, temperature=1.0,
                             speculative_method="self", num_speculative_tokens=3, draft_layers=1,
                             speculative_auto_off=False)


@pytest.fixture(scope="module")
def srv(loop):
    """The OpenAI-compatible server (uvicorn on a free port, in a thread) over the test module's `loop` fixture."""
    from engine.entrypoints.openai.api_server import ServerThread, build_app
    with ServerThread(build_app(loop)) as s:
        yield s
