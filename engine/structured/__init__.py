"""Structured output: constrain generation to a JSON schema, a regex, a list of choices or a Lark grammar.

params.py    StructuredOutputsParams (what a request asks for; plain values, validated, picklable)
compiler.py  GrammarCompiler: request -> llguidance matcher, compiled once per distinct constraint (cached)
bitmask.py   the per-step token bitmask: filled on the host by llguidance, applied to the constrained
             rows of the logits before sampling

Masks come from llguidance (Rust, CPU): one abi3 wheel for every Python >= 3.9 with no dependencies,
JSON schema / regex / choice / Lark, grammars compiled lazily (about a millisecond) and a token mask
in tens of microseconds per row, computed for a whole batch on its own thread pool.
"""
