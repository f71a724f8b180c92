"""Tool-call parsers (vLLM's names): a model's text output -> OpenAI `tool_calls`, whole or streamed.

- `hermes` (Hermes, Qwen 2.5/3, SmolLM2 and other ChatML models): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text outside the tags is content.
- `llama3_json` (Llama 3.x): the whole output is one JSON object `{"name": ..., "parameters": {...}}`
  (optionally after `<|python_tag|>`), or several separated by `;`.

Streaming holds back text that may be the start of a call and emits each call as one delta once it is
complete (its name and its whole arguments), so a client never sees half a call or a tag as content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str                  # JSON text, as OpenAI sends it

    def to_dict(self, id_: str | None = None) -> dict:
        return {"id": id_ or tool_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(obj, args_key: str) -> ToolCall | None:
    """{"name": str, args_key: object} -> a ToolCall; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):           # some models send the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """extract(text) -> (content or None, calls); streaming() -> a per-choice StreamingToolParser."""

    name = ""
    prompt_format = ""              # how to call a tool, for models whose chat template does not render tools

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def streaming(self) -> "StreamingToolParser":
        return StreamingToolParser(self)

    def render_call(self, name: str, arguments: dict) -> str:
        """An earlier assistant tool call, as text this parser would read back (templates without tool support)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    prompt_format = ('For each function call, return a JSON object with the function name and arguments within '
                     '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                     '<args-json-object>}\n</tool_call>')

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.start not in text:
            return text, []
        content, calls, rest = text[:text.index(self.start)], [], text
        while self.start in rest:
            body = rest[rest.index(self.start) + len(self.start):]
            if self.end in body:
                body, rest = body[:body.index(self.end)], body[body.index(self.end) + len(self.end):]
            else:
                rest = ""
            try:
                call = _call_from(json.loads(body.strip()), "arguments")
            except ValueError:
                call = None
            if call is None:                  # not a call after all: everything is content
                return text, []
            calls.append(call)
        content = (content + rest).strip()
        return content or None, calls

    def render_call(self, name: str, arguments: dict) -> str:
        return f"{self.start}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.end}"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    prompt_format = ('To call a function, respond only with a JSON object of the form {"name": <function-name>, '
                     '"parameters": <args-json-object>} and nothing else.')

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, j = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = j
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def render_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


class StreamingToolParser:
    """One streamed choice: feed(delta_text) -> (content to send now, calls completed now); finish() at the
    end -> (held-back content, calls). Text that might start a call is held back until it is decided."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.buf = ""                   # text not yet sent as content nor parsed into calls
        self.in_call = False            # hermes: inside <tool_call>; llama3_json: the output is a call
        self.decided = False            # llama3_json: whether the output starts as a call is known

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        if isinstance(self.parser, HermesToolParser):
            return self._feed_hermes()
        return self._feed_llama()

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        p, content, calls = self.parser, "", []
        while True:
            if self.in_call:
                k = self.buf.find(p.end)
                if k < 0:
                    return content, calls
                _, parsed = p.extract(p.start + self.buf[:k + len(p.end)])
                if not parsed:                      # not JSON: send the tagged text as it came
                    content += p.start + self.buf[:k + len(p.end)]
                calls += parsed
                self.buf, self.in_call = self.buf[k + len(p.end):], False
                continue
            k = self.buf.find(p.start)
            if k >= 0:
                content += self.buf[:k]
                self.buf, self.in_call = self.buf[k + len(p.start):], True
                continue
            keep = next((n for n in range(min(len(p.start) - 1, len(self.buf)), 0, -1)
                         if p.start.startswith(self.buf[-n:])), 0)      # a tag may be starting
            content += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            return content, calls

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if not self.decided:
            s = self.buf.lstrip()
            if not s:
                return "", []
            tag = Llama3JsonToolParser.python_tag
            if tag.startswith(s[:len(tag)]) and len(s) < len(tag):
                return "", []
            self.decided, self.in_call = True, s.startswith("{") or s.startswith(tag)
        if self.in_call:
            return "", []                            # parsed whole at the end
        out, self.buf = self.buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self.buf = self.buf, ""
        if isinstance(self.parser, HermesToolParser):
            if not self.in_call:
                return buf, []
            content, calls = self.parser.extract(self.parser.start + buf)     # an unclosed last call
            return (content or "", calls) if calls else (self.parser.start + buf, [])
        if not self.in_call:
            return buf, []
        content, calls = self.parser.extract(buf)
        return (content or ""), calls


TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def tool_parser_for(name: str | None, chat_template: str | None) -> ToolParser:
    """`--tool-call-parser` when given, else from the chat template: Llama 3's headers -> llama3_json,
    anything else (ChatML: Hermes, Qwen, SmolLM2) -> hermes."""
    if name:
        if name not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser: must be one of {sorted(TOOL_PARSERS)} (got {name!r})")
        return TOOL_PARSERS[name]()
    t = chat_template or ""
    if "<|start_header_id|>" in t or "<|python_tag|>" in t:
        return Llama3JsonToolParser()
    return HermesToolParser()
