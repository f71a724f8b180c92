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


def one(client: OpenAI, model: str, tool_choice, seed: int, stream: bool) -> tuple[list, str | None]:
    kw = dict(model=model, messages=ASK if tool_choice != "auto" else CHAT, tools=TOOLS, tool_choice=tool_choice,
              seed=seed, temperature=1.0, max_tokens=120)
    if not stream:
        m = client.chat.completions.create(**kw).choices[0].message
        return [(c.function.name, c.function.arguments) for c in m.tool_calls or []], m.content
    calls: dict[int, list] = {}
    text = ""
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta if ch.choices else None
        if d is None:
            continue
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, ["", ""])
            c[0] += (tc.function.name or "") if tc.function else ""
            c[1] += (tc.function.arguments or "") if tc.function else ""
    return [tuple(c) for _, c in sorted(calls.items())], text or None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    loop = EngineLoop(EngineConfig(model=args.model, device=args.device, max_model_len=1024,
                                   max_num_seqs=args.concurrency)).start()
    rows = []
    with ServerThread(build_app(loop)) as srv, ThreadPoolExecutor(args.concurrency) as pool:
        client = OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        named = {"type": "function", "function": {"name": "get_weather"}}
        for label, tc in (("required", "required"), ("named get_weather", named), ("auto, no tool needed", "auto")):
            for stream in (False, True):
                t0 = time.perf_counter()
                res = list(pool.map(lambda s: one(client, model, tc, s, stream), range(args.calls)))
                if tc == "auto":
                    ok = sum(1 for calls, text in res if not calls and text)
                else:
                    ok = sum(valid(calls, "get_weather" if tc is named else None) for calls, _ in res)
                rows.append({"tool_choice": label, "stream": stream, "calls": args.calls, "ok": ok,
                             "seconds": round(time.perf_counter() - t0, 1)})
                print_table(rows[-1:], list(rows[-1]))
    loop.shutdown()
    print_table(rows, list(rows[0]))
    print("ok: tool_calls parse and validate against the schema (auto: a text answer, no tool call)")
    path = write_json(f"tool_calls_{slug(device_name(args.device))}", {"model": args.model or "SmolLM2-135M (bundled)",
                                                                 "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
