"""Small helpers several test files share (imported as `helpers`: pytest puts tests/ on sys.path)."""
import copy
import dataclasses
import json
import re
import time

import torch

SPEC_VOCAB = 64             # the vocabulary of the `spec_models` fixture's models


def drain(eng) -> dict:
    """Step an LLMEngine until nothing is left; its finished outputs by request id."""
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def run_requests(eng, prompts, params) -> list:
    """Submit each prompt with its SamplingParams and step to the end; the final outputs in submission order."""
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs = drain(eng)
    return [outs[i] for i in ids]


def add_random_requests(eng, lengths, max_tokens: int, vocab: int, seed: int = 0, **params) -> list[str]:
    """Greedy requests (ignore_eos) on random token-id prompts of the given lengths (seeded); their request ids.
    `params`: more SamplingParams fields (logprobs=5, say)."""
    from engine import SamplingParams
    g = torch.Generator().manual_seed(seed)
    return [eng.add_request(torch.randint(0, vocab, (n,), generator=g).tolist(),
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params))
            for n in lengths]


def multi_turn_tokens(eng, users: int, turns: int, turn_len: int, answer: int, seed: int = 0) -> list[list[int]]:
    """Chats sent one turn at a time, each resending the whole conversation so far plus turn_len new random
    tokens; every answer's greedy tokens, in order (a pool smaller than the conversations makes prefixes leave
    the device between turns)."""
    from engine import SamplingParams
    g = torch.Generator().manual_seed(seed)
    vocab = eng.arch_config.vocab_size
    convs = [[] for _ in range(users)]
    answers = []
    for _ in range(turns):
        for u in range(users):
            convs[u] += torch.randint(0, vocab, (turn_len,), generator=g).tolist()
            out = run_requests(eng, [convs[u]], [SamplingParams(temperature=0, max_tokens=answer,
                                                                  ignore_eos=True)])[0]
            answers.append(out.token_ids)
            convs[u] += out.token_ids
    return answers


def wait_idle(loop, timeout: float = 60.0) -> dict:
    """Wait until every KV block is back on the free list and nothing runs or waits; the loop's stats."""
    full = loop.engine.num_blocks - 1
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        s = loop.stats()
        if s["num_free_blocks"] == full and s["num_running"] == 0 and s["num_waiting"] == 0:
            return s
        time.sleep(0.01)
    raise AssertionError(f"KV blocks not freed or requests left: {loop.stats()}")


def save_random_llama(folder, seed: int, layers: int, scale: float = 0.1, vocab: int = 64, hidden: int = 64,
                      intermediate: int = 128, head_dim: int = 16, max_pos: int = 256):
    """A small random Llama (4 heads, 2 KV heads, untied, bos 0, eos 1) saved to `folder` as safetensors; every
    weight but the norms drawn N(0, scale): outputs that are neither constant nor pure noise. -> the HF model."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=vocab,
                                   max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=0, eos_token_id=1)
    m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.normal_(0, scale)
    m.save_pretrained(folder, safe_serialization=True)
    return m.eval()


def check_block_invariants(eng) -> None:
    """Every block's ref count equals the block tables holding it, free exactly when unreferenced; the null
    block 0 is never held; the prefix-cache index agrees with the blocks' hashes."""
    pool = eng.block_manager.pool
    held = {}
    for s in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        for b in s.block_table:
            held[b] = held.get(b, 0) + 1
    for b in range(1, pool.num_blocks):
        assert pool.ref_counts[b] == held.get(b, 0), f"block {b}"
        assert (b in pool.free) == (pool.ref_counts[b] == 0)
    assert 0 not in held and pool.ref_counts[0] == 0
    for h, b in pool.hash_to_block.items():
        assert pool.block_hash[b] == h


def check_no_leak(eng) -> None:
    """Nothing left to run, every KV block back on the free list, no reference held."""
    bm = eng.block_manager
    assert not eng.has_unfinished_requests()
    assert bm.num_free_blocks == eng.num_blocks - 1
    assert all(c == 0 for c in bm.pool.ref_counts)

def every_code_weight(fmt: str, N: int, K: int, device="cpu") -> dict:
    """A weight of the format whose codes run through every value (fp8: every finite bit pattern, subnormals
    included), with unit scales and zero mins: it dequantizes to the code values themselves."""
    i = torch.arange(N * K, device=device).view(N, K)
    if fmt == "int8":
        return {"weight": (i % 255 - 127).to(torch.int8), "weight_scale": torch.ones(N, 1, device=device)}
    if fmt == "fp8":
        bits = (i % 254).to(torch.uint8)
        bits = torch.where(bits >= 127, bits + 1, bits)                # skip 0x7F (NaN); 0xFF never occurs
        return {"weight": bits.view(torch.float8_e4m3fn),
                "weight_scale_inv": torch.ones(-(-N // 128), -(-K // 128), device=device)}
    return {"qweight": (i[:, :K // 2] % 256).to(torch.uint8),
            "scales": torch.ones(N, K // 128, dtype=torch.float16, device=device),
            "mins": torch.zeros(N, K // 128, dtype=torch.float16, device=device)}


def every_code_weights(fmt: str, K: int = 256) -> dict:
    """Packed-GEMV weights [2, K] (K = 256) holding every code of the format (int4 in the words layout, fp8's NaN
    codes replaced by 0: 0 x NaN would poison a one-hot dot), unit scales: for one-hot decode checks."""
    import torch

    from engine.quant.formats import int4_to_words
    if fmt == "int4":
        codes = torch.arange(16).repeat(2 * K // 16)[: 2 * K].view(2, K).to(torch.uint8)
        packed = codes.view(2, -1, 2, 64)
        return int4_to_words({"qweight": (packed[:, :, 0] | (packed[:, :, 1] << 4)).view(2, -1),
                              "scales": torch.ones(2, 2, dtype=torch.float16),
                              "mins": torch.zeros(2, 2, dtype=torch.float16)})
    if fmt == "int8":
        return {"weight": torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).view(1, K).repeat(2, 1),
                "weight_scale": torch.ones(2, 1)}
    b = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    b[(b & 127) == 127] = 0
    return {"weight": b.view(torch.float8_e4m3fn).view(1, K).repeat(2, 1), "weight_scale_inv": torch.ones(1, 2)}


PACKED_IDS = [5, 9, 13, 200, 7, 11, 3]


def packed_model_and_ref(fmt: str):
    """(one-layer quantized model on the Triton ops, the torch path's prefill-then-decode logits for PACKED_IDS), both
    from the same seed: the packed-GEMV model checks."""
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model
    from tests.test_quant import TINY, _prefill_then_decode
    cfg = {**TINY, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 1, "num_key_value_heads": 1,
           "head_dim": 32}

    def build(ops):
        return build_model(cfg, None, get_ops(ops), torch.device("cpu"), torch.float32, max_pos=64, seed=5,
                           quantization=fmt)
    return build("triton"), _prefill_then_decode(build("torch"), PACKED_IDS)


def scrape_metrics(url: str) -> dict:
    """{(sample name, sorted labels): value} of a server's /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(m: dict, name: str, **labels) -> float:
    """The sum of scrape_metrics samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in m.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


@dataclasses.dataclass
class RecordedRun:
    """What a small workload on a real `dummy:tiny` CPU engine emitted (record_engine_run)."""
    events: list                 # StepEvent and RequestEvent in emission order
    outputs: dict                # request id -> its final RequestOutput, in finishing order
    kv: dict                     # kv_snapshot() after the step with the most blocks in use (shared ones first)
    num_blocks: int
    block_size: int
    arrival_steps: dict          # request id -> the step index before which it was added

    @property
    def steps(self) -> list:
        from engine.events import StepEvent
        return [e for e in self.events if isinstance(e, StepEvent)]

    def request_events(self, kind: str | None = None) -> list:
        from engine.events import RequestEvent
        return [e for e in self.events if isinstance(e, RequestEvent) and (kind is None or e.kind == kind)]

    @property
    def records(self) -> list:
        from inspector.recorder import RequestRecord
        return [RequestRecord.from_output(o) for o in self.outputs.values()]

    def feed(self, recorder) -> None:
        """Replay the events into a Recorder, then hand it the finished outputs."""
        for e in self.events:
            recorder(e)
        for o in self.outputs.values():
            recorder.record_output(o)

    def snapshot(self, **recorder_kw):
        """A fresh Recorder fed with the whole run; its snapshot, with a copy of the peak-usage kv."""
        from inspector.recorder import Recorder
        rec = Recorder(**recorder_kw)
        self.feed(rec)
        return rec.snapshot(kv=copy.deepcopy(self.kv))


def record_engine_run(num_requests: int = 24, seed: int = 0, num_kv_blocks: int = 16, block_size: int = 16,
                      max_num_seqs: int = 8, max_num_batched_tokens: int = 128, shared_prefix_blocks: int = 1,
                      prompt_len: tuple = (8, 40), output_len: tuple = (8, 30), temperature: float = 0.0,
                      **engine_kw) -> RecordedRun:
    """Run a small seeded workload on a `dummy:tiny` CPU engine and record every event it emits.

    Requests share a prefix of `shared_prefix_blocks` full blocks (prefix-cache hits) and arrive two at a time
    every third step (queueing, chunked prefill next to decodes); a small pool preempts. Everything is decided
    by the seed and step counts, never by the clock: the same arguments give the same scheduling."""
    from engine import LLMEngine, SamplingParams
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        eng = LLMEngine(model="dummy:tiny", device="cpu", seed=seed, num_kv_blocks=num_kv_blocks,
                        block_size=block_size, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, **engine_kw)
        vocab = eng.arch_config.vocab_size
        events: list = []
        eng.events.subscribe(events.append)
        g = torch.Generator().manual_seed(seed)
        prefix = torch.randint(3, vocab, (shared_prefix_blocks * block_size,), generator=g).tolist()
        pending = []
        for i in range(num_requests):
            n = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
            m = int(torch.randint(output_len[0], output_len[1] + 1, (1,), generator=g))
            prompt = prefix + torch.randint(3, vocab, (n,), generator=g).tolist()
            pending.append((f"r{i:02d}", prompt, SamplingParams(temperature=temperature, seed=seed * 1000 + i,
                                                                 max_tokens=m, ignore_eos=True)))
        outputs, arrival_steps = {}, {}
        best, kv = (-1, -1), None
        step = 0
        while pending or eng.has_unfinished_requests():
            if step % 3 == 0:
                for rid, prompt, sp in pending[:2]:
                    eng.add_request(prompt, sp, request_id=rid)
                    arrival_steps[rid] = step
                del pending[:2]
            for o in eng.step():
                if o.finished:
                    outputs[o.request_id] = o
            snap = eng.kv_snapshot()
            in_use = sum(1 for c in snap["ref_counts"] if c > 0)
            key = (sum(1 for c in snap["ref_counts"] if c > 1) > 0, in_use)
            if key >= best:
                best, kv = key, snap
            step += 1
        eng.close()
        return RecordedRun(events=events, outputs=outputs, kv=kv, num_blocks=eng.num_blocks, block_size=block_size,
                           arrival_steps=arrival_steps)
    finally:
        torch.set_num_threads(threads)


class _Truncated(Exception):
    pass


_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_JSON_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9][0-9]*)(\.[0-9]*)?([eE][+-]?[0-9]*)?")


def json_prefix_kind(text: str) -> str:
    """"complete" if `text` is one JSON document, "prefix" if it is cut short of one (some continuation would make it
    valid), ValueError where it can never become valid JSON: how to check a constrained generation that ran out of
    tokens."""
    i = 0

    def peek() -> str:
        if i >= len(text):
            raise _Truncated
        return text[i]

    def ws():
        nonlocal i
        while i < len(text) and text[i] in " \t\n\r":
            i += 1

    def expect(word: str):
        nonlocal i
        for ch in word:
            if peek() != ch:
                raise ValueError(f"expected {word!r} at {i}: {text[i:i + 20]!r}")
            i += 1

    def string():
        nonlocal i
        expect('"')
        while True:
            c = peek()
            i += 1
            if c == '"':
                return
            if c == "\\":
                e = peek()
                i += 1
                if e == "u":
                    for _ in range(4):
                        if peek() not in "0123456789abcdefABCDEF":
                            raise ValueError(f"bad \\u escape at {i}")
                        i += 1
                elif e not in '"\\/bfnrt':
                    raise ValueError(f"bad escape at {i}")
            elif ord(c) < 0x20:
                raise ValueError(f"control character in a string at {i}")

    def number():
        nonlocal i
        m = _JSON_NUMBER.match(text, i)
        if _JSON_NUMBER_PREFIX.fullmatch(text, i) and not (m and m.end() == len(text)):
            raise _Truncated                            # "-", "1.", "2e+": a number cut short
        if not m:
            raise ValueError(f"bad number at {i}: {text[i:i + 20]!r}")
        i = m.end()

    def value():
        ws()
        c = peek()
        if c == "{":
            container("{", "}", member)
        elif c == "[":
            container("[", "]", value)
        elif c == '"':
            string()
        elif c in "tfn":
            expect({"t": "true", "f": "false", "n": "null"}[c])
        else:
            number()

    def member():
        ws()
        string()
        ws()
        expect(":")
        value()

    def container(open_: str, close: str, item):
        nonlocal i
        expect(open_)
        ws()
        if peek() == close:
            i += 1
            return
        while True:
            item()
            ws()
            c = peek()
            i += 1
            if c == close:
                return
            if c != ",":
                raise ValueError(f"expected ',' or {close!r} at {i - 1}: {text[i - 1:i + 20]!r}")

    try:
        value()
    except _Truncated:
        return "prefix"
    ws()
    if i != len(text):
        raise ValueError(f"trailing text at {i}: {text[i:i + 20]!r}")
    return "complete"


def check_half_cancelled_storm(url: str, loop, n: int) -> None:
    """n concurrent streams (n <= max_waiting_requests), every other one closed after its first chunk, while
    /metrics is scraped: none is refused, the others get all 8 tokens, running + waiting never exceeds n, and
    both return to 0."""
    import asyncio
    import json

    import httpx
    peak = [0.0]

    def parse(text: str) -> dict:
        from prometheus_client.parser import text_string_to_metric_families
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def in_system(m: dict) -> float:
        return metric_sum(m, "kvscope:num_requests_running") + metric_sum(m, "kvscope:num_requests_waiting")

    async def storm() -> list:
        done = asyncio.Event()

        async def watch():
            async with httpx.AsyncClient(timeout=30) as c:
                while not done.is_set():
                    peak[0] = max(peak[0], in_system(parse((await c.get(url + "/metrics")).text)))
                    await asyncio.sleep(0.02)

        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n + 4)) as c:
            async def one(i: int):
                body = {"prompt": [3 + i % 50, 9, 27], "max_tokens": 8, "stream": True, "ignore_eos": True,
                        "return_token_ids": True}
                async with c.stream("POST", url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        return r.status_code
                    got = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            got += len(json.loads(line[6:])["choices"][0]["token_ids"])
                            if i % 2:
                                return "closed"          # leaving the block drops the connection
                    return got
            w = asyncio.ensure_future(watch())
            try:
                return await asyncio.gather(*(one(i) for i in range(n)))
            finally:
                done.set()
                await w

    results = asyncio.run(storm())
    assert [r for r in results if isinstance(r, int) and r >= 400] == []
    assert results[0::2] == [8] * (n // 2) and results[1::2] == ["closed"] * (n // 2)
    assert peak[0] <= n
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end and in_system(scrape_metrics(url)):
        time.sleep(0.02)
    assert in_system(scrape_metrics(url)) == 0
    s = loop.stats()
    assert s["num_running"] == s["num_waiting"] == 0


def random_llama_weights(cfg: dict, seed: int = 3) -> dict[str, torch.Tensor]:
    """Float weights, in Hugging Face's Llama names, for an HF config with an untied LM head: N(0, 0.05) projections
    and head, N(0, 0.5) embeddings, unit norms."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    w = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.5,
         "lm_head.weight": torch.randn(cfg["vocab_size"], h, generator=g) * 0.05,
         "model.norm.weight": torch.ones(h)}
    for layer in range(cfg["num_hidden_layers"]):
        for name, shape in shapes.items():
            w[f"model.layers.{layer}.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
        w[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(h)
        w[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(h)
    return w


def write_checkpoint(folder, cfg: dict, tensors: dict[str, torch.Tensor]):
    """A model folder kvscope loads: config.json and model.safetensors. Returns the folder."""
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
