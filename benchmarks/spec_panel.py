"""The inspector's speculative-decoding panel fed from a real run: the bundled SmolLM2 with n-gram drafting (k=4),
8 rewrite prompts then 8 chat prompts (chat-templated), with the inspector's Recorder attached to the engine's
events. `record` runs the engine (the device: bf16, CUDA graphs) and writes the snapshot's spec counters as JSON;
`render` builds the panel from that JSON with the inspector's figure code and writes a PNG (this machine).

    python benchmarks/spec_panel.py record --device cuda        # -> benchmarks/results/spec_panel_<device>.json
    python benchmarks/spec_panel.py render benchmarks/results/spec_panel_nvidia-h200.json assets/spec_panel_h200.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def record(device: str, max_tokens: int) -> None:
    from benchmarks.bench_spec import WORKLOADS
    from benchmarks.common import device_name, slug, write_json
    from engine import LLM, SamplingParams
    from inspector.recorder import Recorder
    llm = LLM(device=device, speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4,
              max_num_seqs=16)
    rec = Recorder().attach(llm.engine.events)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for name in ("rewrite", "chat"):
        texts = [llm.engine.apply_chat_template([{"role": "user", "content": p}]) for p in WORKLOADS[name]]
        llm.generate(texts, sp, use_tqdm=False)
    spec = rec.snapshot().spec
    print({k: v for k, v in spec.items() if k != "history"}, f"{len(spec.get('history') or [])} history rows")
    write_json(f"spec_panel_{slug(device_name(device))}", dict(device=device_name(device), workloads=["rewrite", "chat"],
                                                               max_tokens=max_tokens, spec=spec))


def render(src: str, png: str) -> None:
    from benchmarks.common import write_png
    from inspector.figures.layout import as_figure
    from inspector.figures.spec_decode import spec_spec
    data = json.loads(Path(src).read_text())
    fig = as_figure(spec_spec(SimpleNamespace(spec=data["spec"]), height=360))
    head = f"{data['device']}: bundled SmolLM2, n-gram k=4, 8 rewrite then 8 chat requests"
    fig.update_layout(title_text=f"{head}<br><span style='font-size:12px'>{fig.layout.title.text}</span>",
                      margin=dict(t=110))
    print("written by", write_png(fig, Path(png), width=1100, height=400), "->", png)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["record", "render"])
    ap.add_argument("paths", nargs="*", help="render: the JSON and the PNG")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.device, args.max_tokens)
    else:
        render(*args.paths)


if __name__ == "__main__":
    main()
