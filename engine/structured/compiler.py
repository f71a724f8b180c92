"""GrammarCompiler: a request's StructuredOutputsParams -> an llguidance matcher, compiled once per constraint.

Compilation runs where the request is validated (`make_sequence`, on the caller's thread: the API server's
worker, EngineLoop.submit's caller), never inside an engine step, so a request reaches the scheduler with
its grammar ready. Each distinct constraint is compiled once into a fresh matcher kept in an LRU cache;
a request gets a deep copy of it (microseconds). An invalid constraint raises ValueError naming the field.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

from engine.structured.params import StructuredOutputsParams

# Compact JSON (no free whitespace between tokens): small models otherwise spend their token budget on
# newlines. A schema may override it with llguidance's "x-guidance" options.
JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer = None                                   # llguidance.LLTokenizer, built on first use
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()   # key -> fresh LLMatcher
        self.num_compiled = 0

    def _lltokenizer(self):
        if self._tokenizer is None:
            if self.hf_tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer, so no grammar can be built")
            import llguidance.hf
            # EOS ids the tokenizer knows (a random-weight preset borrowing SmolLM2's tokenizer has others too)
            eos = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)]
            # ~0.5 s for a 49k vocabulary: once per engine. The tokenizer's own vocabulary when the model's is
            # padded beyond it: llguidance consumes and masks ~10x slower with ids it has no bytes for.
            n_vocab = self.vocab_size if len(self.hf_tokenizer) >= self.vocab_size else None
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab, eos_token=eos or None)
        return self._tokenizer

    @property
    def mask_vocab_size(self) -> int:
        """Token ids the masks cover (ids past them, a model vocabulary's padding, are never allowed)."""
        with self._lock:
            return self._lltokenizer().vocab_size

    def matcher(self, so: StructuredOutputsParams):
        """A fresh matcher for this constraint (at the start of the output). Thread-safe."""
        key = so.key()
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
                return proto.deep_copy()
            tok = self._lltokenizer()
        proto = self._compile(so, tok)                          # outside the lock: may take a while
        with self._lock:
            self._cache[key] = proto
            self.num_compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return proto.deep_copy()

    def _compile(self, so: StructuredOutputsParams, tok):
        import llguidance
        from llguidance import LLMatcher
        kind = so.kind
        field = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                grammar = LLMatcher.grammar_from_json_schema(so.json, defaults=JSON_DEFAULTS)
            elif kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(so.regex)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(so.choice))
            else:
                grammar = llguidance.grammar_from("grammar", so.grammar)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        m = LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            what = {"json": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid grammar"}
            raise ValueError(f"{field}: {what.get(kind, 'invalid constraint')}: {m.get_error().strip()}")
        return m
