"""Priority scheduling (EngineConfig.scheduling_policy="priority", SamplingParams.priority; vLLM's semantics:
lower is sooner): admission order, preemption of worse running requests (for blocks and for batch slots),
greedy outputs unchanged, FCFS untouched, the API's `priority` field, validation, and the inspector's
request events. Outcomes are decided by engine steps only, never by wall-clock time."""
import httpx
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runtime.async_engine import EngineLoop
from engine.entrypoints.openai.api_server import ServerThread, build_app
from engine.events import RequestEvent, StepEvent
from engine.core.scheduler import PriorityWaitingQueue
from helpers import drain

MODEL = "dummy:tiny"


def alone(prompt, sp, **cfg):
    eng = LLMEngine(model=MODEL, device="cpu", **cfg)
    eng.add_request(prompt, sp)
    (out,) = drain(eng).values()
    return out.token_ids


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompt(k, n=8):
    return [(k * 37 + j * 11) % 4000 + 5 for j in range(n)]


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [1.5, "1", True, None, 2 ** 63])
def test_sampling_params_priority_must_be_an_int(bad):
    with pytest.raises(ValueError, match=r"SamplingParams.priority: must be an int"):
        SamplingParams(priority=bad)


def test_priority_values_and_policy_validation():
    assert SamplingParams().priority == 0 and SamplingParams(priority=-3).priority == -3
    assert EngineConfig().scheduler_config.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match=r"EngineConfig.scheduling_policy: must be one of \('fcfs', 'priority'\)"):
        EngineConfig(scheduling_policy="lifo")


def test_waiting_queue_orders_by_priority_then_arrival():
    from engine.core.sequence import Sequence
    q = PriorityWaitingQueue()
    seqs = [Sequence(f"r{i}", None, [1, 2], SamplingParams(priority=p), arrival_time=t)
            for i, (p, t) in enumerate([(0, 1.0), (1, 0.5), (-1, 3.0), (0, 1.0), (0, 0.9)])]
    for s in seqs:
        q.push(s)
    assert [s.request_id for s in q] == ["r2", "r4", "r0", "r3", "r1"]   # ties on arrival: insertion order
    assert len(q) == 5 and q and seqs[3] in q
    q.remove(seqs[4])
    with pytest.raises(ValueError):
        q.remove(seqs[4])
    assert [q.pop().request_id for _ in range(4)] == ["r2", "r0", "r3", "r1"] and not q


# ---------------------------------------------------------------- admission order
@pytest.mark.slow
def test_high_priority_request_is_admitted_before_earlier_waiting_ones():
    # 2 slots held by priority-0 requests; 6 priority-5 requests wait; a priority-0 request arrives last.
    # It is not strictly better than the running ones (no preemption) but goes ahead of every waiting one.
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=2,
                    scheduling_policy="priority")
    run = [eng.add_request(prompt(i), greedy(6), priority=0) for i in range(2)]
    low = [eng.add_request(prompt(10 + i), greedy(4), priority=5) for i in range(6)]
    eng.step()
    assert [s.request_id for s in eng.scheduler.running] == run
    high = eng.add_request(prompt(99), greedy(4), priority=0)
    assert next(iter(eng.scheduler.waiting)).request_id == high
    order = []
    eng.events.subscribe(lambda e: isinstance(e, RequestEvent) and e.kind == "scheduled" and order.append(e.request_id))
    outs = drain(eng)
    assert order[0] == high and sorted(order[1:]) == sorted(low)
    assert order[1:] == low                                # equal priorities: arrival order
    assert eng.scheduler.num_preemptions == 0
    assert set(outs) == set(run + low + [high])


@pytest.mark.slow
def test_strictly_better_arrival_preempts_for_a_batch_slot():
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=2,
                    scheduling_policy="priority")
    a = eng.add_request(prompt(1), greedy(8))
    b = eng.add_request(prompt(2), greedy(8))
    eng.step()
    eng.step()
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    high = eng.add_request(prompt(3), greedy(4), priority=-1)
    eng.step()
    assert steps[0].preempted == [b]                       # the latest arrival of the worst priority
    assert {s.request_id for s in steps[0].scheduled} == {a, high}
    outs = drain(eng)
    assert outs[b].metrics.num_preemptions == 1 and outs[a].metrics.num_preemptions == 0
    assert outs[high].token_ids == alone(prompt(3), greedy(4), num_kv_blocks=64, block_size=4)
    assert outs[b].token_ids == alone(prompt(2), greedy(8), num_kv_blocks=64, block_size=4)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_step_budget_goes_to_the_better_priority_first(policy):
    # a low-priority 64-token prompt is being prefilled in 16-token chunks when a high-priority request arrives
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                    scheduling_policy=policy)
    low = eng.add_request(prompt(1, n=64), greedy(4))
    eng.step()
    sp = greedy(4)
    if policy == "priority":
        sp.priority = -1
    high = eng.add_request(prompt(2, n=8), sp)
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    eng.step()
    got = {s.request_id: s.num_tokens for s in steps[0].scheduled}
    if policy == "priority":
        assert got == {high: 8}                       # the whole short prompt first, no worse prompt chunk beside it
    else:
        assert got == {low: 16}                       # FCFS: the running chunk takes the budget
    outs = drain(eng)
    assert outs[high].token_ids == alone(prompt(2, n=8), greedy(4), num_kv_blocks=64, block_size=4)
    assert outs[low].token_ids == alone(prompt(1, n=64), greedy(4), num_kv_blocks=64, block_size=4)


# ---------------------------------------------------------------- memory pressure
@pytest.mark.slow
@pytest.mark.parametrize("prefix", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_memory_pressure_high_priority_preempts_worst_running_and_outputs_are_unchanged(prefix):
    cfg = dict(num_kv_blocks=20, block_size=4, enable_prefix_caching=prefix)   # 19 usable blocks = 76 tokens
    eng = LLMEngine(model=MODEL, device="cpu", scheduling_policy="priority", **cfg)
    low_p = {eng.add_request(prompt(i), greedy(24), priority=0): prompt(i) for i in range(2)}
    l1, l2 = list(low_p)
    for _ in range(8):                                     # both decoding: 16 tokens = 4 blocks each
        eng.step()
    assert [s.request_id for s in eng.scheduler.running] == [l1, l2]
    hp = prompt(50, n=48)                                  # 12 blocks: more than the 11 free
    events = []
    eng.events.subscribe(events.append)
    high = eng.add_request(hp, greedy(6), priority=-1)
    eng.step()
    step = next(e for e in events if isinstance(e, StepEvent))
    assert step.preempted == [l2]                          # worst running: same priority, later arrival
    assert high in {s.request_id for s in step.scheduled}
    outs = drain(eng)
    reqs = [e for e in events if isinstance(e, RequestEvent)]
    assert {e.priority for e in reqs if e.request_id == high} == {-1}
    assert {e.priority for e in reqs if e.request_id in low_p} == {0}
    finish = [e.request_id for e in reqs if e.kind == "finished"]
    assert finish.index(high) < finish.index(l2)
    assert outs[high].token_ids == alone(hp, greedy(6), **cfg)
    for rid, p in low_p.items():
        assert outs[rid].token_ids == alone(p, greedy(24), **cfg), rid
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
    assert not eng.scheduler.running and not eng.scheduler.waiting


@pytest.mark.slow
def test_running_victim_is_the_worst_priority_not_the_last_admitted():
    # three decoding requests outgrow a small pool; the earliest admitted has the worst priority
    cfg = dict(num_kv_blocks=16, block_size=4, enable_prefix_caching=False)    # 15 usable blocks
    eng = LLMEngine(model=MODEL, device="cpu", scheduling_policy="priority", **cfg)
    pr = {eng.add_request(prompt(i), greedy(16), priority=p): (prompt(i), p) for i, p in enumerate([3, 0, 1])}
    worst = next(r for r, (_, p) in pr.items() if p == 3)
    events = []
    eng.events.subscribe(events.append)
    outs = drain(eng)
    pre = [r for e in events if isinstance(e, StepEvent) for r in e.preempted]
    assert pre and pre[0] == worst
    for rid, (p, _) in pr.items():
        assert outs[rid].token_ids == alone(p, greedy(16), **cfg), rid
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


def test_waiting_abort_and_equal_priorities_behave():
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    ids = [eng.add_request(prompt(i), greedy(3)) for i in range(4)]
    eng.step()
    eng.abort_request(ids[2])                              # removed from the heap
    assert [s.request_id for s in eng.scheduler.waiting] == [ids[1], ids[3]]
    outs = drain(eng)
    assert set(outs) == {ids[0], ids[1], ids[3]} and eng.scheduler.num_preemptions == 0


# ---------------------------------------------------------------- FCFS unchanged
def _trace(policy, priorities):
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=13, block_size=4, max_num_seqs=2,
                    enable_prefix_caching=False, scheduling_policy=policy)
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(
        ([(s.request_id, s.num_tokens, s.phase) for s in e.scheduled], e.preempted, e.finished)))
    ids = [eng.add_request(prompt(i), SamplingParams(max_tokens=30, ignore_eos=True, priority=p, temperature=0),
                           request_id=f"r{i}") for i, p in enumerate(priorities)]
    outs = drain(eng)
    return steps, [outs[i].token_ids for i in ids], type(eng.scheduler.waiting).__name__


@pytest.mark.slow
def test_fcfs_ignores_priorities_and_priority_policy_with_equal_priorities_matches_it():
    base, toks, kind = _trace("fcfs", [0, 0, 0])
    assert kind == "deque"
    assert any(p for _, p, _ in base)                      # the workload does preempt
    assert _trace("fcfs", [5, -3, 1])[:2] == (base, toks)  # FCFS: priorities change nothing
    same, toks2, kind2 = _trace("priority", [0, 0, 0])
    assert kind2 == "PriorityWaitingQueue" and toks2 == toks
    assert same == base                                    # all equal: the same schedule as FCFS here


# ---------------------------------------------------------------- OpenAI API
@pytest.fixture(scope="module", params=["fcfs", "priority"])
def api(request):
    loop = EngineLoop(EngineConfig(model=MODEL, device="cpu", num_kv_blocks=64, max_model_len=256,
                                   scheduling_policy=request.param)).start()
    with ServerThread(build_app(loop)) as srv:
        yield request.param, srv.url
    loop.shutdown()


@pytest.mark.parametrize("path, body", [
    ("completions", {"prompt": "Hello there", "max_tokens": 3}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
])
def test_api_priority_field(api, path, body):
    policy, url = api
    for prio in (0, -1, 7):
        r = httpx.post(f"{url}/v1/{path}", json={**body, "priority": prio}, timeout=60)
        if policy == "fcfs" and prio != 0:
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "priority" and "priority" in err["message"]
        else:
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
    r = httpx.post(f"{url}/v1/{path}", json={**body, "priority": "1"}, timeout=60)   # strict: no coercion
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_step_prefilling_a_better_request_still_decodes_worse_ones():
    """A worse request that is decoding keeps decoding in the step that prefills a better one."""
    eng = LLMEngine(model=MODEL, device="cpu", num_kv_blocks=64, block_size=4, max_num_batched_tokens=64,
                    scheduling_policy="priority")
    low = eng.add_request(prompt(1, n=12), greedy(6))
    eng.step()                                         # low's prompt; it decodes from now on
    sp = greedy(3)
    sp.priority = -1
    high = eng.add_request(prompt(2, n=8), sp)
    steps = []
    eng.events.subscribe(lambda e: isinstance(e, StepEvent) and steps.append(e))
    eng.step()
    assert {s.request_id: s.num_tokens for s in steps[0].scheduled} == {high: 8, low: 1}
    outs = drain(eng)
    assert outs[low].token_ids == alone(prompt(1, n=12), greedy(6), num_kv_blocks=64, block_size=4)
