"""Tool calls through the OpenAI server with the official `openai` client: for tool_choice "required" and a named
function, N seeded sampled calls (temperature 1), streamed and not; counts the calls whose output parses into
tool_calls whose arguments validate against the function's JSON schema. Also `auto` with a prompt that needs
no tool: how many answer with text.

    python benchmarks/check_tool_calls.py [--model MODEL] [--calls 50] [--device cpu]

Prints a table and writes benchmarks/results/tool_calls_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402
from openai import OpenAI  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import EngineConfig  # noqa: E402
from engine.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402
from engine.runtime.async_engine import EngineLoop  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CHAT = [{"role": "user", "content": "Say hello to me in one short sentence."}]


def valid(calls: list[tuple[str, str]], want: str | None) -> bool:
    if not calls or (want and any(n != want for n, _ in calls)):
        return False
    try:
        for name, args in calls:
            jsonschema.validate(json.loads(args), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError, KeyError):
        return False
    return True


def one(client: OpenAI, model: str, tool_choice, seed: int, stream: bool, max_tokens: int
        ) -> tuple[list, str | None, str]:
    kw = dict(model=model, messages=ASK if tool_choice != "auto" else CHAT, tools=TOOLS, tool_choice=tool_choice,
              seed=seed, temperature=1.0, max_tokens=max_tokens)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        m = c.message
        return [(t.function.name, t.function.arguments) for t in m.tool_calls or []], m.content, c.finish_reason
    calls: dict[int, list] = {}
    text, finish = "", None
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta if ch.choices else None
        if d is None:
            continue
        finish = ch.choices[0].finish_reason or finish
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, ["", ""])
            c[0] += (tc.function.name or "") if tc.function else ""
            c[1] += (tc.function.arguments or "") if tc.function else ""
    return [tuple(c) for _, c in sorted(calls.items())], text or None, finish


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--modes", nargs="+", default=["required", "named", "auto"])
    ap.add_argument("--stream", nargs="+", default=["off", "on"])
    args = ap.parse_args()
    loop = EngineLoop(EngineConfig(model=args.model, device=args.device, max_model_len=1024,
                                   max_num_seqs=args.concurrency)).start()
    rows = []
    with ServerThread(build_app(loop)) as srv, ThreadPoolExecutor(args.concurrency) as pool:
        client = OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        named = {"type": "function", "function": {"name": "get_weather"}}
        modes = {"required": "required", "named": named, "auto": "auto"}
        failures = []
        for label in args.modes:
            tc = modes[label]
            for stream in (s == "on" for s in args.stream):
                t0 = time.perf_counter()
                res = list(pool.map(lambda s: one(client, model, tc, s, stream, args.max_tokens), range(args.calls)))
                if tc == "auto":
                    good = [not calls and bool(text) for calls, text, _ in res]
                else:
                    good = [valid(calls, "get_weather" if tc is named else None) for calls, _, _ in res]
                failures += [{"mode": label, "stream": stream, "seed": s, "finish_reason": r[2], "calls": r[0],
                              "content": r[1]} for s, (g, r) in enumerate(zip(good, res)) if not g]
                rows.append({"tool_choice": label, "stream": stream, "calls": args.calls, "ok": sum(good),
                             "seconds": round(time.perf_counter() - t0, 1)})
                print_table(rows[-1:], list(rows[-1]))
                print(*failures[-5:], sep="\n", flush=True)
    loop.shutdown()
    print_table(rows, list(rows[0]))
    print("ok: tool_calls parse and validate against the schema (auto: a text answer, no tool call)")
    path = write_json(f"tool_calls_{slug(device_name(args.device))}", {"model": args.model or "SmolLM2-135M (bundled)",
                                                                 "rows": rows, "failures": failures})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
