"""Real text for simulated users: chat prompts built from a small text set bundled with kvscope
(`assets/load_text.json`, written for the project, CC0), rendered with the model's chat template, so
speculative-decoding acceptance and prefix sharing under load are those of text, not of random ids.

A prompt is one task ("Summarize the following text...") and passages from the set, cut to the sampled
length; with a shared prefix the set's system prompt (repeated up to the length) is the shared part, and
each request's own tokens are its templated user turn."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np

TEXT_FILE = Path(__file__).resolve().parents[2] / "assets" / "load_text.json"


@lru_cache(maxsize=1)
def text_set() -> dict:
    return json.loads(TEXT_FILE.read_text())


def can_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


class TextPrompts:
    """Seeded templated prompts for one tokenizer."""

    def __init__(self, tokenizer, rng: np.random.Generator):
        self.tok, self.rng, self.data = tokenizer, rng, text_set()

    def _render(self, messages: list[dict], gen: bool) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        return self.tok.encode(text, add_special_tokens=False)

    def system_prefix(self, length: int) -> tuple[list[int], str]:
        """(the templated system turn of about `length` tokens, its text)."""
        base, text = self.data["system"], self.data["system"]
        while len(self.tok.encode(text, add_special_tokens=False)) < length:
            text += " " + base
        overhead = len(self._render([{"role": "system", "content": ""}], False))
        ids = self.tok.encode(text, add_special_tokens=False)[:max(1, length - overhead)]
        text = self.tok.decode(ids)
        return self._render([{"role": "system", "content": text}], False), text

    def _content(self, budget: int) -> str:
        d = self.data
        parts = [d["tasks"][self.rng.integers(len(d["tasks"]))]]
        while len(self.tok.encode(" ".join(parts), add_special_tokens=False)) < budget:
            parts.append(d["passages"][self.rng.integers(len(d["passages"]))])
            if parts[0].startswith("Answer"):
                parts.append(d["questions"][self.rng.integers(len(d["questions"]))])
        ids = self.tok.encode("\n\n".join(parts), add_special_tokens=False)[:max(1, budget)]
        return self.tok.decode(ids)

    def user_turn(self, length: int, system: str | None) -> list[int]:
        """The tokens a request adds: its templated user turn (and the generation prompt), at most `length`
        tokens when the template's own tokens leave room. With `system`, the turn that follows that system
        prompt (the system turn is the shared prefix); without, the whole rendering of one user message."""
        sys_msgs = [{"role": "system", "content": system}] if system is not None else []
        head = self._render(sys_msgs, False) if sys_msgs else []
        overhead = len(self._render(sys_msgs + [{"role": "user", "content": ""}], True)) - len(head)
        full = self._render(sys_msgs + [{"role": "user", "content": self._content(length - overhead)}], True)
        if head and full[:len(head)] == head:
            return full[len(head):]
        return full
