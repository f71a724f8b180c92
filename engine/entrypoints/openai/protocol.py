"""OpenAI-compatible request/response shapes (pydantic).

Requests are parsed strictly (JSON types are not coerced: `"max_tokens": "10"` is an error), a field this
server does not implement is a 400 naming it (nothing is silently dropped), and every error names the
field it is about, the way OpenAI does: `{"error": {"message", "type", "param", "code"}}`.

Beyond OpenAI's fields the requests accept vLLM's sampling extensions under vLLM's names: `top_k`,
`min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`, `ignore_eos`,
`include_stop_str_in_output`, `skip_special_tokens`, `return_token_ids`, `return_tokens_as_token_ids`,
`truncate_prompt_tokens`, `priority` (400 unless the engine runs `scheduling_policy="priority"`, as in vLLM);
`use_beam_search` only as false.

Structured output: OpenAI's `response_format` (`{"type": "json_object"}` or `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`) on both endpoints, plus the extensions `regex`, `choice`
(a list of strings) and `grammar` (Lark), or vLLM's `structured_outputs` object with one of `json`, `regex`,
`choice`, `grammar`; at most one constraint per request. Chat tools: tools.py.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.sampling_params import MAX_LOGPROBS

from engine.entrypoints.openai.errors import APIError
from engine.entrypoints.openai.tools import ToolChoice, check_tool_choice, check_tools, tool_constraint

MAX_N = 64                 # choices per request
MAX_PROMPTS = 256          # prompts in one /v1/completions request
MAX_LOGIT_BIAS = 1024      # tokens biased per request
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
LOGPROB_FLOOR = -9999.0    # JSON has no -inf; masked tokens report this (as vLLM does)


# --------------------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM: usage on every chunk


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None     # token id (a JSON key) -> bias; ints after validation
    user: str | None = None
    metadata: dict[str, str] | None = None     # OpenAI's: stored nowhere, affects nothing
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    priority: int = 0                  # vLLM: lower is scheduled sooner; needs scheduling_policy="priority"
    # structured output (OpenAI's response_format; regex / choice / grammar are extensions)
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None     # vLLM's name for the same constraints
    # vLLM extensions
    truncate_prompt_tokens: int | None = Field(None, ge=-1)   # keep the prompt's last k tokens (-1: max_model_len - 1)
    return_tokens_as_token_ids: bool = False            # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # top-n per prompt token (from the prefill)
    use_beam_search: bool = False                       # accepted only as false

    def structured_constraint(self) -> dict | None:
        """The request's constraint as StructuredOutputsParams fields, or None; APIError on a bad shape."""
        found = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise APIError("response_format.json_schema.schema: is required and must be a JSON schema "
                                   "object", param="response_format")
                found["response_format"] = {"json": js["schema"]}
            elif kind != "text":
                raise APIError(f"response_format.type: must be 'text', 'json_object' or 'json_schema' "
                               f"(got {kind!r})", param="response_format")
        for name in ("regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                found[name] = {name: getattr(self, name)}
        so = self.structured_outputs
        if so is not None:                      # vLLM's form: {"json" | "regex" | "choice" | "grammar": ...}
            given = {k: v for k, v in so.items() if v is not None and v is not False}
            unknown = set(given) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown or len(given) != 1:
                raise APIError(f"structured_outputs: set exactly one of json, regex, choice, grammar, json_object "
                               f"(got {', '.join(sorted(given)) or 'none'})", param="structured_outputs")
            found["structured_outputs"] = given
        if len(found) > 1:
            raise APIError(f"{', '.join(found)}: send at most one structured-output constraint",
                           param=next(iter(found)))
        return next(iter(found.values()), None)

    def structured_param_names(self) -> dict[str, str]:
        """Engine field -> request parameter, for errors (`structured_outputs.json: ...` -> response_format)."""
        if self.structured_outputs is not None:
            return {}                           # the engine's names are this request's names
        src = "response_format" if self.response_format is not None else \
            next((n for n in ("regex", "choice", "grammar") if getattr(self, n) is not None), "response_format")
        return {"structured_outputs": src, "structured_outputs.json": "response_format",
                "structured_outputs.json_object": "response_format", "structured_outputs.regex": "regex",
                "structured_outputs.choice": "choice", "structured_outputs.grammar": "grammar"}

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > 16:
            raise ValueError("at most 16 stop strings")
        if not all(v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("seed", "priority")
    @classmethod
    def _seed(cls, v):
        if v is not None and not (-(2 ** 63) <= v < 2 ** 63):
            raise ValueError("must be a signed 64-bit integer")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v is not None and not all(t >= 0 for t in v):
            raise ValueError("must be non-negative token ids")
        return v

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                     "repetition_penalty")
    @classmethod
    def _finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v is None:
            return None
        bad = [k for k in v if not (k.isascii() and k.isdigit()) or len(k) > 12]
        if bad:
            raise ValueError(f"keys must be token ids (got {', '.join(repr(k[:20]) for k in bad[:8])})")
        out = {}
        for k, b in v.items():
            if not (math.isfinite(b) and -100 <= b <= 100):
                raise ValueError(f"bias of token {k} must be in [-100, 100] (got {b})")
            out[int(k)] = float(b)
        if len(out) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
        return out or None

    def check_unsupported(self) -> None:
        if self.truncate_prompt_tokens == 0:
            raise APIError("truncate_prompt_tokens: must be -1 (max_model_len - 1) or >= 1 (got 0)",
                           param="truncate_prompt_tokens")
        if self.use_beam_search:
            raise APIError("use_beam_search: beam search is not supported by this server", param="use_beam_search",
                           code="unsupported")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options: only allowed when stream is true", param="stream_options")
        self.structured_constraint()              # its shape errors before anything is tokenized

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingRequest):
    prompt: Any
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        ok_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in x)
        if isinstance(v, str):
            return [v]
        if ok_ids(v):
            return [v]
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(ok_ids(p) for p in v)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists (none of them empty)")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix: is not supported by this server", param="suffix", code="unsupported")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of: only best_of == n is supported", param="best_of", code="unsupported")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True   # vLLM extension
    continue_final_message: bool = False  # vLLM extension: the last (assistant) message is continued, not closed

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        if not v:
            raise ValueError("must be a non-empty list of messages")
        out = []
        for i, m in enumerate(v):
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"message {i}: 'role' must be a non-empty string")
            if role not in CHAT_ROLES:
                raise ValueError(f"message {i}: unknown role {role[:40]!r}; expected one of {', '.join(CHAT_ROLES)}")
            content = m.get("content")
            calls = m.get("tool_calls") if role == "assistant" else None
            if content is None:
                if role != "assistant":
                    raise ValueError(f"message {i}: 'content' is required")
                content = ""
            elif isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ValueError(f"message {i} content part {j}: only {{'type': 'text', 'text': ...}} "
                                         "parts are supported")
                    parts.append(p["text"])
                content = "\n".join(parts)
            elif not isinstance(content, str):
                raise ValueError(f"message {i}: 'content' must be a string or a list of text parts")
            msg = {"role": role, "content": content}
            if calls:
                if not isinstance(calls, list) or not all(
                        isinstance(c, dict) and isinstance(c.get("function"), dict)
                        and isinstance(c["function"].get("name"), str)
                        and isinstance(c["function"].get("arguments"), (str, dict)) for c in calls):
                    raise ValueError(f"message {i}: 'tool_calls' must be a list of {{'id', 'type': 'function', "
                                     "'function': {'name', 'arguments'}}")
                msg["tool_calls"] = [{"id": str(c.get("id", "")), "type": "function",
                                      "function": {"name": c["function"]["name"],
                                                   "arguments": c["function"]["arguments"]}} for c in calls]
            if role == "tool" and m.get("tool_call_id") is not None:
                if not isinstance(m["tool_call_id"], str):
                    raise ValueError(f"message {i}: 'tool_call_id' must be a string")
                msg["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                msg["name"] = m["name"]
            out.append(msg)
        return out

    @field_validator("tools")
    @classmethod
    def _tools(cls, v):
        if v is None:
            return None
        try:
            return check_tools(v) or None
        except APIError as e:
            raise ValueError(e.message)

    def tool_choice_mode(self) -> ToolChoice:
        return check_tool_choice(self.tool_choice, self.tools)

    def structured_constraint(self) -> dict | None:
        """As the base class, plus the grammar that enforces tool_choice `required` or a named function."""
        found = super().structured_constraint()
        enforced = tool_constraint(self.tool_choice_mode(), self.tools or [], self.parallel_tool_calls)
        if enforced is not None and found is not None:
            raise APIError("tool_choice: 'required' or a named function cannot be combined with another "
                           "structured-output constraint", param="tool_choice")
        return enforced if enforced is not None else found

    def structured_param_names(self) -> dict[str, str]:
        names = super().structured_param_names()
        if self.tools and self.tool_choice_mode().enforced:
            names.update({"structured_outputs": "tools", "structured_outputs.json": "tools"})
        return names

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.tool_choice_mode()
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message: cannot be true together with add_generation_prompt",
                           param="continue_final_message")
        if self.continue_final_message and self.messages[-1]["role"] != "assistant":
            raise APIError("continue_final_message: the last message must be an assistant message",
                           param="continue_final_message")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError("max_completion_tokens: conflicts with max_tokens; send one of them",
                           param="max_completion_tokens")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# --------------------------------------------------------------------------------------- responses
def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def _name(lp, as_ids: bool) -> str:
    """A token as logprobs name it: its text, or vLLM's `token_id:<id>` (return_tokens_as_token_ids)."""
    return f"token_id:{lp.token_id}" if as_ids else lp.decoded


def completion_logprobs(entries: list, text_offset: int, top_n: int, as_ids: bool = False) -> dict:
    """Legacy completions logprobs for a run of tokens; each entry is [chosen, top-n...] Logprobs (logprobs=0:
    the chosen token alone, as OpenAI)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for e in entries:
        chosen = e[0]
        tokens.append(_name(chosen, as_ids))
        token_lps.append(_lp(chosen.logprob))
        d = {_name(t, as_ids): _lp(t.logprob) for t in e[1:1 + top_n]}
        d.setdefault(_name(chosen, as_ids), _lp(chosen.logprob))
        tops.append(d)
        offsets.append(off)
        off += len(chosen.decoded)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(*parts: dict) -> dict:
    """Legacy completions logprobs of consecutive runs (echoed prompt, then output) as one."""
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def echo_logprobs(prompt_entries: list, first_text: str, first_id: int, top_n: int, as_ids: bool) -> dict:
    """Legacy completions logprobs of an echoed prompt: its first token has none (null), as OpenAI's."""
    head = {"tokens": [f"token_id:{first_id}" if as_ids else first_text], "token_logprobs": [None],
            "top_logprobs": [None], "text_offset": [0]}
    return join_logprobs(head, completion_logprobs(prompt_entries[1:], len(first_text), top_n, as_ids))


def vllm_prompt_logprobs(entries: list, as_ids: bool = False) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the prompt token and the top-n."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        out.append({str(lp.token_id): {"logprob": _lp(lp.logprob), "rank": lp.rank,
                                       "decoded_token": _name(lp, as_ids)} for lp in reversed(e)})
    return out


def chat_logprobs(entries: list, top_n: int, as_ids: bool = False) -> dict:
    def one(lp):
        return {"token": _name(lp, as_ids), "logprob": _lp(lp.logprob), "bytes": list(lp.decoded.encode("utf-8"))}

    content = []
    for e in entries:
        item = one(e[0])
        item["top_logprobs"] = [one(t) for t in e[1:1 + top_n]]
        content.append(item)
    return {"content": content}


FinishReason = Literal["stop", "length", "abort"]
