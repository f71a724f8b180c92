"""Tool calling on /v1/chat/completions: a request's `tools` / `tool_choice` -> the prompt, the constraint that
enforces `required` or a named function, and the output -> OpenAI `tool_calls` (whole or as stream deltas).

- The prompt: a chat template that uses `tools` renders them (and assistant `tool_calls`, `tool` messages);
  for one that does not (the bundled SmolLM2's) a system prompt lists the tools as JSON and says how to call
  one in the parser's format, and earlier calls / results are written as text in that format.
- `auto`: the model chooses; its output is parsed by the tool parser (tool_parsers.py).
- `required` and a named function are enforced by a JSON-schema grammar (as vLLM does): a named function's
  output is its arguments object, validated against the function's `parameters`; `required` produces a JSON
  array of `{"name", "parameters"}` objects, one item unless `parallel_tool_calls` is true or unset.
- `none` (or no tools): plain text, the tools are not rendered.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.tool_parsers import ToolCall, ToolParser, tool_call_id

ANY_OBJECT = {"type": "object"}


def check_tools(tools: list) -> list[dict]:
    """OpenAI's `tools` -> [{"type": "function", "function": {"name", "description"?, "parameters"}}]."""
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           "...}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise APIError(f"tools[{i}].function.name: must be a non-empty string of at most 64 characters",
                           param="tools")
        if name in names:
            raise APIError(f"tools[{i}].function.name: {name!r} is defined twice", param="tools")
        names.add(name)
        params = fn.get("parameters", ANY_OBJECT)
        if not isinstance(params, dict):
            raise APIError(f"tools[{i}].function.parameters: must be a JSON schema object", param="tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise APIError(f"tools[{i}].function.description: must be a string", param="tools")
        f = {"name": name, "parameters": params}
        if desc:
            f["description"] = desc
        out.append({"type": "function", "function": f})
    return out


@dataclass
class ToolChoice:
    mode: str                        # "none" | "auto" | "required" | "named"
    name: str | None = None          # the named function

    @property
    def enforced(self) -> bool:
        return self.mode in ("required", "named")


def check_tool_choice(tool_choice, tools: list[dict] | None) -> ToolChoice:
    if tool_choice is not None and not tools:
        raise APIError("tool_choice: is only allowed when tools are given", param="tool_choice")
    if not tools:
        return ToolChoice("none")
    if tool_choice is None:
        return ToolChoice("auto")
    if tool_choice in ("none", "auto", "required"):
        return ToolChoice(tool_choice)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)):
        raise APIError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                       f"{{'name': ...}}}} (got {str(tool_choice)[:80]})", param="tool_choice")
    if fn["name"] not in {t["function"]["name"] for t in tools}:
        raise APIError(f"tool_choice: function {fn['name']!r} is not among the tools", param="tool_choice")
    return ToolChoice("named", fn["name"])


def tool_constraint(choice: ToolChoice, tools: list[dict], parallel: bool | None) -> dict | None:
    """The JSON schema (StructuredOutputsParams fields) that enforces `required` or a named function."""
    if choice.mode == "named":
        fn = next(t["function"] for t in tools if t["function"]["name"] == choice.name)
        return {"json": closed_objects(fn["parameters"])}
    if choice.mode == "required":
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "parameters": closed_objects(t["function"]["parameters"])}}
                 for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if parallel is False:
            schema["maxItems"] = 1
        return {"json": schema}
    return None


def closed_objects(schema):
    """The schema with `additionalProperties: false` on every object schema that lists `properties` and says
    nothing about extra ones (xgrammar's strict mode, vLLM's default): a call's arguments are the declared
    parameters, and the model cannot wander into undeclared keys until max_tokens runs out."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_objects(v) if k in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then",
                                          "else", "additionalProperties", "contains") else v)
           for k, v in schema.items()}
    for k in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed_objects(v) for name, v in schema[k].items()}
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


# ------------------------------------------------------------------------------------------- prompt
TOOLS_SYSTEM_PROMPT = ("You are a function calling AI model. You are given function signatures within <tools></tools> "
                       "XML tags. You may call one or more functions to assist with the user query. Don't make "
                       "assumptions about what values to plug into functions.\n<tools>\n{tools}\n</tools>\n\n{format}")


def template_renders_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_messages(messages: list[dict], tools: list[dict] | None, parser: ToolParser,
                      native: bool) -> list[dict]:
    """The request's messages as the chat template gets them. native: the template renders tools itself (its
    assistant messages get `tool_calls` with arguments as objects, as Hugging Face templates expect); else
    the tools go into a system prompt and earlier calls / results become text in the parser's format."""
    out = []
    for m in messages:
        m = dict(m)
        if m["role"] == "developer":        # OpenAI's newer name for the system message; templates know "system"
            m["role"] = "system"
        calls = m.get("tool_calls")
        if calls:
            parsed = [(c["function"]["name"], _arguments(c["function"]["arguments"])) for c in calls]
            if native:
                m["tool_calls"] = [{**c, "function": {"name": n, "arguments": a}} for c, (n, a) in zip(calls, parsed)]
            else:
                del m["tool_calls"]
                m["content"] = "\n".join([m["content"]] * bool(m["content"]) + [parser.render_call(n, a)
                                                                               for n, a in parsed])
        if m["role"] == "tool" and not native and parser.name == "hermes":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools and not native:
        prompt = TOOLS_SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools),
                                            format=parser.prompt_format)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def render_chat(engine, messages: list[dict], tools: list[dict] | None, choice: ToolChoice, parser: ToolParser,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The prompt for `messages` with `tools` offered (none under tool_choice "none"): rendered by the chat
    template when it knows tools, else through the injected system prompt (template_messages)."""
    offered = tools if choice.mode != "none" else None
    native = template_renders_tools(getattr(engine.tokenizer, "chat_template", None))
    return engine.apply_chat_template(template_messages(messages, offered, parser, native), add_generation_prompt,
                                      offered if native else None, continue_final_message)


def _arguments(a) -> dict:
    try:
        v = json.loads(a) if isinstance(a, str) else a
    except ValueError:
        v = None
    return v if isinstance(v, dict) else {"value": a}


# ------------------------------------------------------------------------------------------- output
def parse_output(text: str, choice: ToolChoice, parser: ToolParser, parallel: bool | None
                 ) -> tuple[str | None, list[ToolCall]]:
    """A finished choice's text -> (content, tool calls). Output that does not parse (cut by max_tokens) stays
    content; for `required`, the calls completed before the cut are returned (as vLLM's streamed deltas would
    have delivered them)."""
    if choice.mode == "named":
        try:
            ok = isinstance(json.loads(text), dict)
        except ValueError:
            ok = False
        return (None, [ToolCall(choice.name, text)]) if ok else (text, [])
    if choice.mode == "required":
        try:
            calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                     for c in _complete_items(text)]
        except (TypeError, KeyError):
            calls = []
        return (None, calls) if calls else (text, [])
    if choice.mode == "auto":
        content, calls = parser.extract(text)
        return content, calls[:1] if parallel is False else calls
    return text, []


def _complete_items(text: str) -> list:
    """The items of a JSON array that are complete: all of them, or those before the one max_tokens cut
    (the grammar makes each complete item a valid call)."""
    dec, items, i = json.JSONDecoder(), [], len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return items
    i += 1
    while True:
        i += len(text[i:]) - len(text[i:].lstrip())
        try:
            item, i = dec.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)
        i += len(text[i:]) - len(text[i:].lstrip())
        if not text.startswith(",", i):
            return items
        i += 1


def finish_reason(reason: str | None, choice: ToolChoice, calls: bool) -> str | None:
    """OpenAI's: 'tool_calls' when the model chose to call (auto / required); a named function's call ends 'stop'."""
    return "tool_calls" if calls and reason == "stop" and choice.mode in ("auto", "required") else reason


class ToolStream:
    """One streamed choice: feed(delta_text) -> (content delta, tool_call deltas), finish() -> the rest.
    A named function's arguments stream as they are generated; other calls arrive whole, one delta each."""

    def __init__(self, choice: ToolChoice, parser: ToolParser, parallel: bool | None):
        self.choice, self.parallel = choice, parallel
        self.stream = parser.streaming() if choice.mode == "auto" else None
        self.buf = ""
        self.index = 0                       # the next call's index
        self.named_started = False

    def _deltas(self, calls: list[ToolCall]) -> list[dict]:
        if self.parallel is False:
            calls = calls[:max(0, 1 - self.index)]
        out = []
        for c in calls:
            out.append({"index": self.index, **c.to_dict()})
            self.index += 1
        return out

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        mode = self.choice.mode
        if mode == "named":
            if not delta:
                return "", []
            if not self.named_started:
                self.named_started, self.index = True, 1
                return "", [{"index": 0, "id": tool_call_id(), "type": "function",
                             "function": {"name": self.choice.name, "arguments": delta}}]
            return "", [{"index": 0, "function": {"arguments": delta}}]
        if mode == "required":
            self.buf += delta
            return "", []
        if mode == "auto":
            content, calls = self.stream.feed(delta)
            return content, self._deltas(calls)
        return delta, []

    def finish(self) -> tuple[str, list[dict]]:
        if self.choice.mode == "required":
            content, calls = parse_output(self.buf, self.choice, None, self.parallel)
            return (content or ""), self._deltas(calls)
        if self.choice.mode == "auto":
            content, calls = self.stream.finish()
            return content, self._deltas(calls)
        return "", []

    @property
    def called(self) -> bool:
        return self.index > 0
