"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's names)."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema (object or its JSON text)
    regex: str | None = None                # the whole output matches this regex (Rust `regex` syntax)
    choice: list[str] | None = None         # the output is exactly one of these strings
    grammar: str | None = None              # a Lark grammar (llguidance's dialect), or GBNF
    json_object: bool = False               # any JSON object (OpenAI's response_format json_object)

    def __post_init__(self):
        def need(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"structured_outputs.{name}: {msg} (got {getattr(self, name)!r})"[:300])

        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)} (got "
                             f"{', '.join(given) or 'none'})")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
            else:
                parsed = self.json
            need(isinstance(parsed, (dict, bool)), "json", "must be a JSON schema (an object)")
        need(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex",
             "must be a non-empty string")
        need(self.choice is None or (isinstance(self.choice, list) and len(self.choice) > 0
                                     and all(isinstance(c, str) and c for c in self.choice)),
             "choice", "must be a non-empty list of non-empty strings")
        need(self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
             "grammar", "must be a non-empty string")
        need(isinstance(self.json_object, bool), "json_object", "must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        k = self.kind
        if k == "json":
            v = self.json if isinstance(self.json, str) else _json.dumps(self.json, sort_keys=True)
        elif k == "choice":
            v = _json.dumps(self.choice)
        elif k == "json_object":
            v = ""
        else:
            v = getattr(self, k)
        return k, v

    @classmethod
    def coerce(cls, v: Any) -> "StructuredOutputsParams | None":
        """None, an instance, or its dict form (what crosses a process boundary)."""
        if v is None or isinstance(v, cls):
            return v
        if isinstance(v, dict):
            unknown = set(v) - set(KINDS)
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {sorted(unknown)}; allowed: {list(KINDS)}")
            return cls(**v)
        raise ValueError(f"structured_outputs: must be a StructuredOutputsParams or a dict (got {type(v).__name__})")
