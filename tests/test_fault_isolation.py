"""One request never harms another: sampling parameters the sampler cannot compute are refused at submission
(naming the field and the limit), and a step that still raises fails only the requests whose rows raise,
while the others run on token-identically and every KV block comes back."""
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.events import RequestEvent, StepFailureEvent
from engine.runtime.async_engine import EngineLoop
from engine.runtime.llm_engine import RequestFailed
from engine.sample.sampler import Sampler
from engine.worker import multi_step
from helpers import drain

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def eng():
    return LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256)


# ------------------------------------------------------------------------------ validation
BAD_PARAMS = [
    # temperature: fp32 divides by it (the fused kernel multiplies by 1 / T)
    (dict(temperature=float("inf")), "temperature", "finite"),
    (dict(temperature=float("nan")), "temperature", "finite"),
    (dict(temperature=1e39), "temperature", r"\[0, 1e\+30\]"),          # finite in fp64, inf in fp32
    (dict(temperature=-1e-300), "temperature", r"\[0, 1e\+30\]"),
    (dict(temperature="1"), "temperature", "finite number"),
    # top_p / min_p: probabilities
    (dict(top_p=float("nan")), "top_p", "finite"),
    (dict(top_p=0.0), "top_p", r"\(0, 1\]"),
    (dict(top_p=1 + 1e-9), "top_p", r"\(0, 1\]"),
    (dict(min_p=float("inf")), "min_p", "finite"),
    (dict(min_p=-5e-324), "min_p", r"\[0, 1\]"),
    # top_k: an int64 on the device
    (dict(top_k=2 ** 63), "top_k", "below 2\\*\\*63"),
    (dict(top_k=-2), "top_k", "positive int"),
    (dict(top_k=2.5), "top_k", "positive int"),
    # repetition penalty: a logit is divided / multiplied by it, then divided by the temperature
    (dict(repetition_penalty=1e-300), "repetition_penalty", r"\[1e-06, 1e\+06\]"),
    (dict(repetition_penalty=5e-324), "repetition_penalty", r"\[1e-06, 1e\+06\]"),    # subnormal
    (dict(repetition_penalty=1e300), "repetition_penalty", r"\[1e-06, 1e\+06\]"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "finite"),
    (dict(repetition_penalty=0.0), "repetition_penalty", r"\[1e-06"),
    # presence / frequency penalties
    (dict(presence_penalty=float("nan")), "presence_penalty", "finite"),
    (dict(presence_penalty=float("-inf")), "presence_penalty", "finite"),
    (dict(frequency_penalty=2.5), "frequency_penalty", r"\[-2, 2\]"),
    (dict(frequency_penalty=True), "frequency_penalty", "finite number"),
    # lengths
    (dict(max_tokens=0), "max_tokens", r"\[1, 2\*\*63\)"),
    (dict(max_tokens=2 ** 63), "max_tokens", r"\[1, 2\*\*63\)"),
    (dict(max_tokens=True), "max_tokens", "int"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", r"\[0, max_tokens\]"),
    # seeds: 64 bits
    (dict(seed=2 ** 64), "seed", r"\[-2\*\*63, 2\*\*64\)"),
    (dict(seed=-2 ** 63 - 1), "seed", r"\[-2\*\*63, 2\*\*64\)"),
    (dict(seed=1.5), "seed", "int"),
    # logprobs, stop ids, priority
    (dict(logprobs=21), "logprobs", r"\[0, 20\]"),
    (dict(logprobs=True), "logprobs", r"\[0, 20\]"),
    (dict(stop_token_ids=[-1]), "stop_token_ids", "non-negative"),
    (dict(stop_token_ids=[2 ** 63]), "stop_token_ids", "non-negative"),
    (dict(priority=2 ** 63), "priority", r"2\*\*63"),
]


@pytest.mark.parametrize("kw, field, limit", BAD_PARAMS, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD_PARAMS)])
def test_bad_sampling_params_name_field_and_limit(kw, field, limit):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: .*{limit}"):
        SamplingParams(**kw)


def test_stop_token_ids_checked_against_the_vocabulary(eng):
    V = eng.arch_config.vocab_size
    with pytest.raises(ValueError, match=rf"^stop_token_ids: must be token ids in \[0, {V}\)"):
        eng.add_request([1, 2], SamplingParams(stop_token_ids=[V], min_tokens=2))
    every = [t for t in range(V) if t not in eng.eos_token_ids]       # with EOS: every token banned
    with pytest.raises(ValueError, match="^stop_token_ids: .*min_tokens .* no token to sample"):
        eng.add_request([1, 2], SamplingParams(stop_token_ids=every, min_tokens=2, max_tokens=4))
    assert not eng.has_unfinished_requests()


def test_values_at_the_limits_run(eng):
    """Every accepted extreme is computable: one batch of them runs to the end without a step failure."""
    edge = [dict(temperature=1e30, seed=3), dict(temperature=1e30), dict(temperature=5e-324),
            dict(temperature=1.0, repetition_penalty=1e-6), dict(temperature=1e-5, repetition_penalty=1e6),
            dict(temperature=1e-5, repetition_penalty=1e-6, top_k=5), dict(top_p=5e-324, temperature=1.0),
            dict(min_p=5e-324, temperature=1.0), dict(min_p=1.0, temperature=2.0, seed=-2 ** 63),
            dict(top_k=2 ** 63 - 1, temperature=1.0, seed=2 ** 64 - 1), dict(presence_penalty=-2,
            frequency_penalty=2, temperature=0.7), dict(logprobs=20, temperature=1e30),
            dict(min_tokens=6, stop_token_ids=list(range(eng.arch_config.vocab_size - 1)), temperature=1.0)]
    before = eng.stats()["step_failures"]
    ids = [eng.add_request([7, 8, 9, i], SamplingParams(max_tokens=6, ignore_eos=True, **kw))
           for i, kw in enumerate(edge)]
    outs = drain(eng)
    assert eng.stats()["step_failures"] == before
    assert [outs[i].finish_reason for i in ids] == ["length"] * len(edge)
    assert all(len(outs[i].token_ids) == 6 for i in ids)


# ------------------------------------------------------------------------------ step-failure isolation
@pytest.fixture
def failing_rows(monkeypatch):
    """Sampler.__call__ raises while a sampled row belongs to a request in the returned set that has produced at
    least `after` tokens (the isolation logic is under test, not the sampler)."""
    bad: set[str] = set()
    real = Sampler.__call__
    after = 2

    def call(self, seqs, mask, logits):
        if any(m and s.request_id in bad and s.num_output_tokens >= after for s, m in zip(seqs, mask)):
            raise FloatingPointError("probability tensor contains either inf, nan or element < 0")
        return real(self, seqs, mask, logits)

    monkeypatch.setattr(Sampler, "__call__", call)
    return bad


def fail_sampling_of(monkeypatch, bad: SamplingParams) -> None:
    """Multi-step blocks raise whenever a row has params `bad`; single steps raise once such a row has two
    tokens (the isolation is under test, not the sampler)."""
    real_block, real_step = multi_step.sample_unseeded, Sampler.__call__

    def block_sample(logits, rows, *a, **kw):
        if any(r.params is bad for r in rows):
            raise FloatingPointError("block sampling failed")
        return real_block(logits, rows, *a, **kw)

    def step_sample(self, seqs, mask, logits):
        if any(m and s.params is bad and s.num_output_tokens >= 2 for s, m in zip(seqs, mask)):
            raise FloatingPointError("step sampling failed")
        return real_step(self, seqs, mask, logits)

    monkeypatch.setattr(multi_step, "sample_unseeded", block_sample)
    monkeypatch.setattr(Sampler, "__call__", step_sample)


def _prompts(n):
    return [[3 + i, 11, 29, 5 + 2 * i] * (1 + i % 3) for i in range(n)]


def test_failed_step_fails_only_its_culprits(eng, failing_rows):
    prompts = _prompts(6)
    base_ids = [eng.add_request(p, SamplingParams(max_tokens=10, **GREEDY)) for p in prompts]
    baseline = drain(eng)
    free0 = eng.block_manager.num_free_blocks
    events = []
    unsub = eng.events.subscribe(events.append)
    try:
        before = eng.stats()
        ids = [eng.add_request(p, SamplingParams(max_tokens=10, **GREEDY)) for p in prompts]
        for k in (1, 4):                    # two of the six raise from their third token on
            failing_rows.add(ids[k])
        outs = drain(eng)
        failed = eng.pop_failed()
    finally:
        unsub()
    assert set(failed) == {ids[1], ids[4]} and all("FloatingPointError" in w for w in failed.values())
    for k in (1, 4):
        assert outs[ids[k]].finish_reason == "abort" and len(outs[ids[k]].token_ids) == 2
    for k in (0, 2, 3, 5):                   # the others: the tokens of a run without the bad requests
        assert outs[ids[k]].finish_reason == "length"
        assert outs[ids[k]].token_ids == baseline[base_ids[k]].token_ids
    s = eng.stats()
    assert s["step_failures"] - before["step_failures"] >= 1
    assert s["failed"] - before["failed"] == 2
    assert eng.block_manager.num_free_blocks == free0 == eng.num_blocks - 1
    assert s["num_running"] == s["num_waiting"] == 0 and not eng.seqs
    fails = [e for e in events if isinstance(e, StepFailureEvent)]
    assert fails and sorted(r for e in fails for r in e.failed) == sorted([ids[1], ids[4]])
    assert all(e.num_retries >= 2 for e in fails)
    kinds = {(e.request_id, e.kind) for e in events if isinstance(e, RequestEvent)}
    assert (ids[1], "failed") in kinds and (ids[4], "failed") in kinds
    assert (ids[1], "aborted") not in kinds and (ids[0], "finished") in kinds


def test_engine_loop_fails_only_the_culprits_stream(failing_rows):
    """Through EngineLoop (what the server and the Playground use): the bad request's stream raises
    RequestFailed, the others complete with the tokens they get alone; the inspector sees the failure."""
    from inspector.recorder import Recorder
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=16,
                                 max_model_len=256)) as loop:
        prompts = _prompts(4)
        alone = [loop.submit(p, SamplingParams(max_tokens=12, **GREEDY)).result(60).token_ids for p in prompts]
        rec = Recorder().attach(loop.engine.events)
        try:
            streams = [loop.submit(p, SamplingParams(max_tokens=12, **GREEDY), request_id=f"ok-{i}")
                       for i, p in enumerate(prompts[:3])]
            failing_rows.add("bad-0")
            bad = loop.submit(prompts[3], SamplingParams(max_tokens=12, **GREEDY), request_id="bad-0")
            with pytest.raises(RequestFailed, match="engine step failed for this request: FloatingPointError"):
                bad.result(60)
            assert [s.result(60).token_ids for s in streams] == alone[:3]
            snap = rec.snapshot()
        finally:
            rec.detach()
        assert snap.request_map["bad-0"].status == "failed" and "FloatingPointError" in snap.request_map["bad-0"].message
        assert snap.totals["step_failures"] >= 1 and snap.totals["failed"] == 1
        s = loop.stats()
        assert s["num_free_blocks"] == s["num_blocks"] - 1 and s["num_running"] == s["num_waiting"] == 0


def test_failed_multi_step_block_falls_back_to_isolating_single_steps(monkeypatch):
    """A multi-step decode block that raises is dropped (its tokens were never processed); single steps then
    isolate the request whose rows raise, and the others' tokens are those of a run without it."""
    eng = LLMEngine(model="dummy:tiny", device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256,
                    num_scheduler_steps=4)
    blocks = []
    eng.events.subscribe(lambda e: blocks.append(e.num_decode_steps) if hasattr(e, "num_decode_steps") else None)
    prompts = _prompts(4)
    base = [eng.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts]
    baseline = drain(eng)
    assert max(blocks) > 1                      # the workload runs multi-step blocks
    bad = SamplingParams(max_tokens=12, **GREEDY)
    fail_sampling_of(monkeypatch, bad)
    ids = [eng.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts]
    culprit = eng.add_request([50, 51, 52], bad)
    outs = drain(eng)
    assert [outs[i].token_ids for i in ids] == [baseline[i].token_ids for i in base]
    assert outs[culprit].finish_reason == "abort" and list(eng.pop_failed()) == [culprit]
    assert eng.stats()["step_failures"] >= 2        # the block, then the step that isolated the culprit
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1


# ------------------------------------------------------------------------------ admission
def test_a_batch_larger_than_the_waiting_queue_is_a_value_error():
    with EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=32, max_waiting_requests=4)) as loop:
        with pytest.raises(ValueError, match=r"^max_waiting_requests: 5 requests .* can never fit .* at most 4"):
            loop.submit_many([([1, 2], SamplingParams(max_tokens=2), None)] * 5)
        assert not loop._streams


def test_waiting_count_never_counts_a_request_twice():
    """Requests arrive while others are cancelled mid-stream: at every arrival (taken on the engine thread, in
    the middle of admitting a whole inbox) running + waiting never exceeds the requests in existence, and it
    returns to 0."""
    live = [0]
    mu = threading.Lock()
    over, errors = [], []
    loop = EngineLoop(EngineConfig(model="dummy:tiny", device="cpu", num_kv_blocks=128, block_size=16,
                                   max_model_len=256, max_num_seqs=8, max_waiting_requests=64))

    def on_event(e):
        if isinstance(e, RequestEvent) and e.kind == "arrived":
            with mu:
                s = loop.metrics_snapshot()
                if s["num_running"] + s["num_waiting"] > live[0]:
                    over.append((s["num_running"], s["num_waiting"], live[0]))

    loop.engine.events.subscribe(on_event)
    loop.start()
    try:
        def user(u: int):
            try:
                for k in range(6):
                    cancel = (u + k) % 2
                    with mu:
                        live[0] += 1
                        st = loop.submit([4 + u, 9, k + 1], SamplingParams(max_tokens=40 if cancel else 6, **GREEDY))
                    if cancel:
                        next(iter(st))
                        st.cancel()
                    out = st.result(60)
                    assert out.finish_reason in (("abort", "length") if cancel else ("length",))
                    with mu:
                        live[0] -= 1
            except BaseException as e:  # noqa: BLE001 - reported by the test thread
                errors.append(e)

        threads = [threading.Thread(target=user, args=(u,)) for u in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads) and errors == []
        s = loop.stats()
        assert over == []
        assert s["num_running"] == s["num_waiting"] == 0 and s["num_free_blocks"] == s["num_blocks"] - 1
    finally:
        loop.shutdown()


# ------------------------------------------------------------------------------ GPU (skipped on CPU)
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_gpu_limits_run_and_isolation_under_graphs_and_multi_step(monkeypatch):
    """On CUDA (Triton kernels, fused Gumbel sampler, CUDA graphs, multi-step blocks): the accepted extremes run
    without a step failure, and a request whose rows raise fails alone while the others stay token-identical."""
    eng = LLMEngine(model="dummy:tiny", device="cuda", dtype="float32", num_kv_blocks=128, block_size=16,
                    max_model_len=256)
    edge = [dict(temperature=1e30), dict(temperature=1e30, top_k=2 ** 63 - 1), dict(temperature=5e-324),
            dict(temperature=1e-5, repetition_penalty=1e6), dict(temperature=1e-5, repetition_penalty=1e-6),
            dict(top_p=5e-324, temperature=1.0), dict(min_p=5e-324, temperature=1.0), dict(min_p=1.0),
            dict(temperature=1.0, seed=2 ** 64 - 1), dict(logprobs=20, temperature=1e30)]
    ids = [eng.add_request([7, 8, 9, i], SamplingParams(max_tokens=24, ignore_eos=True, **kw))
           for i, kw in enumerate(edge)]
    outs = drain(eng)
    assert eng.stats()["step_failures"] == 0
    assert all(outs[i].finish_reason == "length" and len(outs[i].token_ids) == 24 for i in ids)

    prompts = _prompts(6)
    base = [eng.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in prompts]
    baseline = drain(eng)
    bad = SamplingParams(max_tokens=40, **GREEDY)
    fail_sampling_of(monkeypatch, bad)
    again = [eng.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in prompts]
    culprit = eng.add_request([50, 51, 52], bad)
    outs = drain(eng)
    assert [outs[i].token_ids for i in again] == [baseline[i].token_ids for i in base]
    assert outs[culprit].finish_reason == "abort" and list(eng.pop_failed()) == [culprit]
    assert eng.block_manager.num_free_blocks == eng.num_blocks - 1
