"""The soak test's simulated users: each loops until the deadline, picking one action at a time (weights in
ACTIONS), and tallies sent / correct outcomes per action (see benchmarks/soak.py for what each action checks)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

ACTIONS = {"stream": 45, "chat": 10, "disconnect": 12, "cancel": 10, "bad": 12, "too_long": 6, "ui": 5}
GOOD, BAD = ("stream", "chat"), ("bad", "too_long")
PROMPT_IDS = (100, 40000)          # token ids drawn from here (inside every preset's and SmolLM2's vocabulary)
ENGINE_ERROR = "engine:"           # a failure the server explained as its engine stopping or restarting
ENGINE_CODES = ("engine_stopped", "engine_unavailable")


def _why(status: int, body: bytes) -> str:
    """A failed request's reason; prefixed with ENGINE_ERROR when the server said its engine went away."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    prefix = ENGINE_ERROR + " " if code in ENGINE_CODES and status in (200, 503) else ""   # 200: a stream's error
    return f"{prefix}status {status}: {body[:200]!r}"


@dataclass
class Tally:
    # one per request: (sent s, done s, action, outcome, TTFT s of a stream or None, tokens of a good request);
    # outcome "ok", "fail" (counted against the action), "full" (a 503 "retry later": against the action too, but
    # expected while the capacity probe saturates the server), "engine" (a clear engine-stopped error) or
    # "dropped" (a disconnect or cancel the transport broke: nothing to judge)
    records: list = field(default_factory=list)
    failures: list = field(default_factory=list)     # (t, action, message), the first 50 kept
    engine_errors: list = field(default_factory=list)  # (t, action, message): a clear "engine stopped" error

    def count(self, outcome: str | None = None) -> dict:
        """Requests per action (all of them, or those with this outcome)."""
        out = {a: 0 for a in ACTIONS}
        for r in self.records:
            if outcome is None or r[3] == outcome:
                out[r[2]] += 1
        return out

    @property
    def sent(self) -> dict:
        return self.count()

    @property
    def ok(self) -> dict:
        return self.count("ok")

    def fail(self, t0: float, action: str, msg: str) -> None:
        if len(self.failures) < 50:
            self.failures.append((round(time.monotonic() - t0, 1), action, msg[:300]))

    def merge(self, other: "Tally") -> None:
        """Add another process's users' tally to this one."""
        self.records += other.records
        self.failures = (self.failures + other.failures)[:50]
        self.engine_errors += other.engine_errors


class Soak:
    def __init__(self, base: str, model: str, max_model_len: int, args, t0: float):
        self.base, self.model, self.mml, self.args, self.t0 = base.rstrip("/"), model, max_model_len, args, t0
        self.tally = Tally()
        self.deadline = t0 + args.duration
        weights = {a: w for a, w in ACTIONS.items() if a != "ui" or getattr(args, "server", "app") == "app"}
        self.actions, self.action_weights = list(weights), list(weights.values())

    def prompt(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(*PROMPT_IDS) for _ in range(n)]

    async def act(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        """One request: an action drawn by weight, run, and its outcome recorded."""
        action = rng.choices(self.actions, self.action_weights)[0]
        t_sent = round(time.monotonic() - self.t0, 2)
        note: dict = {}                  # what the action measured (a stream: its TTFT)
        try:
            ok, why = await getattr(self, action)(client, rng, note)
        except Exception as e:           # a transport error counts against the action
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok:
            outcome = "ok"
        elif action in (*GOOD, *BAD) and why.startswith(ENGINE_ERROR):
            outcome = "engine"
            self.tally.engine_errors.append((round(time.monotonic() - self.t0, 1), action, why[:300]))
        elif action in (*GOOD, *BAD, "ui"):
            # a 503 "retry later" from a full server is told apart: the capacity probe saturates it on purpose
            outcome = "full" if why.startswith("status 503") else "fail"
            self.tally.fail(self.t0, action, why)
        else:
            outcome = "dropped"
        self.tally.records.append((t_sent, round(time.monotonic() - self.t0, 3), action, outcome,
                                   note.get("ttft") if ok else None, note.get("tokens", 0) if ok else 0))

    async def drive(self, part: int = 0) -> None:
        """This client process's load: arrivals at its share of args.rate, or its users (every procs-th)."""
        procs = self.args.procs
        if self.args.rate:
            await self.arrivals(self.args.rate / procs, seed=self.args.seed * 1000 + part)
        else:
            await asyncio.gather(*(self.user(u) for u in range(part, self.args.users, procs)))

    def _client(self, **kw) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base, timeout=httpx.Timeout(self.args.request_timeout, connect=30.0),
                                 **kw)

    async def user(self, uid: int) -> None:
        """Closed loop: one request at a time, a pause of up to --think-s between them, until the deadline."""
        rng = random.Random(self.args.seed * 1000 + uid)
        async with self._client() as client:
            while time.monotonic() < self.deadline:      # (moved later while a killed engine comes back)
                await self.act(client, rng)
                await asyncio.sleep(rng.uniform(0, self.args.think_s))

    async def arrivals(self, rate: float, seed: int) -> None:
        """Open loop: requests arrive as a Poisson process of `rate` a second until the deadline, each in a task of
        its own however many are still in flight, as a server's independent clients do."""
        rng = random.Random(seed)
        in_flight: set[asyncio.Task] = set()
        async with self._client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=512)) as client:
            t = time.monotonic()
            while True:
                t += rng.expovariate(rate)
                if t >= self.deadline:
                    break
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                task = asyncio.create_task(self.act(client, random.Random(rng.getrandbits(64))))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            if in_flight:
                await asyncio.gather(*in_flight)

    def _body(self, rng, **kw) -> dict:
        return dict(model=self.model, prompt=self.prompt(rng, rng.randint(*self.args.prompt_len)),
                    max_tokens=rng.randint(*self.args.output_len), temperature=0, ignore_eos=True, **kw)

    async def stream(self, client, rng, note):
        body = self._body(rng, stream=True, logprobs=0, stream_options={"include_usage": True})
        n_tok, finish, usage = 0, None, None
        t_sent = time.monotonic()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, _why(r.status_code, await r.aread())
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    return False, _why(200, line[6:].encode())
                for ch in ev.get("choices") or []:
                    n_tok += len((ch.get("logprobs") or {}).get("tokens") or [])
                    finish = ch.get("finish_reason") or finish
                if n_tok and "ttft" not in note:
                    note["ttft"] = round(time.monotonic() - t_sent, 4)     # the request sent -> its first token read
                usage = ev.get("usage") or usage
        want = body["max_tokens"]
        got = (usage or {}).get("completion_tokens")
        if finish != "length" or got != want or n_tok != want:
            return False, f"finish={finish} usage={got} streamed={n_tok} want={want}"
        note["tokens"] = got
        return True, ""

    async def chat(self, client, rng, note):
        want = rng.randint(*self.args.output_len)
        body = dict(model=self.model, max_tokens=want, temperature=0, ignore_eos=True,
                    messages=[{"role": "user", "content": f"Count to {rng.randint(3, 30)}."}])
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return False, _why(r.status_code, r.content)
        got = r.json()["usage"]["completion_tokens"]
        fin = r.json()["choices"][0]["finish_reason"]
        note["tokens"] = got
        return (got == want and fin == "length"), f"finish={fin} usage={got} want={want}"

    async def disconnect(self, client, rng, note):
        body = self._body(rng, stream=True)
        body["max_tokens"] = max(body["max_tokens"], 8)
        stop_after = rng.randint(1, 4)
        async with client.stream("POST", "/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= stop_after:
                    break                     # leaving the block closes the connection mid-stream
        return True, ""

    async def cancel(self, client, rng, note):
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=self._body(rng)), rng.uniform(0.05, 1.0))
        except asyncio.TimeoutError:
            pass
        return True, ""

    async def bad(self, client, rng, note):
        kind = rng.randrange(6)
        body = self._body(rng)
        if kind == 0:
            body["max_tokens"] = -1
        elif kind == 1:
            body["temperature"] = -0.5
        elif kind == 2:
            body["top_p"] = 1.5
        elif kind == 3:
            del body["prompt"]
        elif kind == 4:
            body["model"] = "no-such-model"
        if kind == 5:
            r = await client.post("/v1/completions", content=b'{"prompt": [1, 2,', headers={"content-type":
                                                                                            "application/json"})
        else:
            r = await client.post("/v1/completions", json=body)
        return 400 <= r.status_code < 500, f"bad #{kind}: " + _why(r.status_code, r.content)

    async def too_long(self, client, rng, note):
        body = dict(model=self.model, prompt=self.prompt(rng, self.mml + rng.randint(1, 64)), max_tokens=4)
        r = await client.post("/v1/completions", json=body)
        return 400 <= r.status_code < 500, _why(r.status_code, r.content)

    async def ui(self, client, rng, note):
        r = await client.get("/")
        return r.status_code == 200, f"status {r.status_code}"


def users_process(base: str, model: str, max_model_len: int, args, t0: float, part: int) -> Tally:
    """Client process `part` of args.procs (soak.py --procs): its share of the users, or of the arrival rate
    (--rate). One Python client falls behind a GPU server's token rate, and its own lag would read as the
    server's latency."""
    soak = Soak(base, model, max_model_len, args, t0)
    asyncio.run(soak.drive(part))
    return soak.tally
