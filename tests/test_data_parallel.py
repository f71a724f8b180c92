"""Data parallelism: the router (least loaded, prefix affinity within a load margin), and two engine processes
behind one client giving one engine's greedy tokens, each labelled in /metrics."""
import pytest

from engine import SamplingParams
from engine.core.kv_cache_manager import prompt_block_hashes
from engine.runtime.dp_client import PrefixRouter, replica_device

BS = 16


def test_router_prefers_the_replica_holding_the_prefix_unless_much_busier():
    r = PrefixRouter(2, BS, capacity=1000, imbalance=2)
    system = list(range(100, 100 + 3 * BS))                    # a shared 3-block prefix
    assert r.route(system + [1, 2, 3], [0, 0]) == 0            # nothing cached: least loaded (first on a tie)
    assert r.route(list(range(500, 540)), [1, 0]) == 1         # no shared prefix: least loaded
    assert r.route(system + [4, 5], [2, 1]) == 0               # cached on 0, within the margin
    assert r.prefix_routed == 1
    assert r.route(system + [6], [5, 1]) == 1                  # cached on 0, but 0 is too busy
    assert r.route(system + [7], [2, 3]) == 1                  # now replica 1 computed it last
    assert r.prefix_routed == 2
    assert r.route([1] * (BS - 1), [0, 1]) == 0                # shorter than a block: load alone


def test_router_spreads_requests_one_after_another_over_idle_replicas():
    r = PrefixRouter(3, BS, capacity=1000, imbalance=2)
    picks = [r.route(list(range(1000 * i, 1000 * i + 40)), [0, 0, 0]) for i in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert r.route(list(range(9000, 9040)), [1, 0, 1]) == 1      # a load difference still decides


def test_router_forgets_the_oldest_blocks_beyond_capacity():
    r = PrefixRouter(2, BS, capacity=4, imbalance=100)
    a, b = list(range(3 * BS)), list(range(1000, 1000 + 3 * BS))
    r.route(a, [0, 0])
    r.route(b, [1, 0])
    assert len(r.owner) == 4 and prompt_block_hashes(a, BS)[0] not in r.owner


def test_replica_devices():
    assert [replica_device("cuda", i, 2) for i in range(3)] == ["cuda:0", "cuda:2", "cuda:4"]
    assert replica_device("cuda:1", 1, 1) == "cuda:2" and replica_device("cpu", 3, 1) == "cpu"


@pytest.mark.slow
def test_dp2_same_greedy_tokens_and_metrics_per_replica():
    from engine import LLM
    from engine.entrypoints.openai.metrics import EngineCollector
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM("dummy:tiny", device="cpu", dtype="float32")
    ref = [o.token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    one.close()
    dp = LLM("dummy:tiny", device="cpu", dtype="float32", data_parallel_size=2)
    try:
        out = [o.token_ids for o in dp.generate(prompts, sp, use_tqdm=False)]
        per = dp.client.replica_stats()
        fams = {f.name: f for f in EngineCollector(lambda: dp.client, lambda _: "tiny").collect()}
    finally:
        dp.close()
    assert out == ref
    assert [s["finished"] for s in per] == [3, 3]              # six equal-cost requests: least loaded alternates
    gen = {s.labels["engine"]: s.value for s in fams["kvscope:generation_tokens"].samples
           if s.name.endswith("_total")}
    assert gen == {"0": 18, "1": 18}


@pytest.fixture(scope="module")
def context_model(tmp_path_factory):
    """A random Llama whose greedy tokens depend on the whole context (dummy:tiny's repeat the last token)."""
    from helpers import save_random_llama
    folder = tmp_path_factory.mktemp("dp_model")
    save_random_llama(folder, seed=5, layers=2)
    return dict(model=str(folder), device="cpu", dtype="float32", kernels="torch", block_size=4, num_kv_blocks=48)


def test_in_process_replicas_give_one_engines_tokens_tag_their_events_and_free_their_blocks(context_model):
    from collections import Counter

    from engine.config import EngineConfig
    from engine.events import RequestEvent, StepEvent
    from engine.runtime.async_engine import EngineLoop
    from engine.runtime.dp_loop import DPEngineLoop
    prompts = [[(7 * i + 3 * j) % 60 + 2 for j in range(6 + 5 * i)] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with EngineLoop(EngineConfig(**context_model)) as one:
        ref = [s.result(60).token_ids for s in one.submit_many([(p, sp, None) for p in prompts])]
    events = []
    with DPEngineLoop(EngineConfig(data_parallel_size=2, **context_model)) as dp:
        assert [e.engine_index for e in dp.engines] == [0, 1]
        for eng in dp.engines:
            eng.events.subscribe(events.append)
        out = [s.result(60).token_ids for s in dp.submit_many([(p, sp, None) for p in prompts])]
        per = dp.replica_stats()
        kv = dp.kv_snapshot()
        free = [eng.block_manager.num_free_blocks for eng in dp.engines]
    assert out == ref and len(set(map(tuple, ref))) > 1
    home = {e.request_id: e.engine_index for e in events if isinstance(e, RequestEvent) and e.kind == "arrived"}
    assert sorted(Counter(home.values()).items()) == [(0, 3), (1, 3)]      # six equal-cost requests alternate
    assert all(e.engine_index == home[e.request_id] for e in events if isinstance(e, RequestEvent))
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert all(home[sr.request_id] == e.engine_index for e in steps for sr in e.scheduled)
    assert {e.engine_index for e in steps} == {0, 1}
    assert [s["finished"] for s in per] == [3, 3]
    assert free == [s["num_blocks"] - 1 for s in per] and not any(k["block_tables"] for k in kv["replicas"])


def test_in_process_replicas_refuse_tensor_parallelism():
    from engine.runtime.dp_loop import DPEngineLoop
    with pytest.raises(ValueError, match="tensor_parallel_size: in-process data-parallel replicas need 1"):
        DPEngineLoop(model="dummy:tiny", device="cpu", data_parallel_size=2, tensor_parallel_size=2)
