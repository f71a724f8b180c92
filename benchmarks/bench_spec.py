"""Speculative decoding benchmark: output tok/s with and without each drafter, acceptance rate and length.

Workloads (chat-templated, greedy, so every method must reproduce the baseline tokens exactly):
  rewrite - repetition-friendly: repeat / fix typos / rename a variable in code / summarise a given text;
  chat    - plain questions whose answers are not in the prompt.
Modes: "b1" runs the first 4 requests one after another (batch 1, the latency case speculation targets);
       "bN" (b4, b8, ...) submits N requests together (continuous batching; the workload's prompts, cycled).
Speculative engines run with their defaults: auto-off on (EngineConfig.speculative_auto_off), verify and
self-drafting steps in CUDA graphs on a GPU (spec_cuda_graphs); "+noauto" turns auto-off off for a method,
"+eager" runs its verify / draft steps eagerly (spec_cuda_graphs=False, a separate engine), "+general" verifies
through the general path instead of the plain-greedy fast path (EngineConfig.spec_fast_verify, same engine),
"+noshadow" probes auto-off by verify steps (EngineConfig.spec_shadow_probes off, same engine), "+long" lets
n-gram drafts grow to --k-long after a draft accepted whole (num_speculative_tokens_max, same engine),
"+everyblock" / "+confirm" / "+prefetch" turn spec_shadow_every_block / spec_shadow_confirm / spec_prefetch on,
"+noeveryblock" / "+noconfirm" / "+noprefetch" off, "+main" all three off (the settings before them) (same engine).
Methods: none; ngram (prompt lookup); self (SmolLM2's first L layers + final norm + LM head); draft (a
separate model: SmolLM2 truncated to its first layers, saved as its own folder, own KV pool: no training).

Usage: python benchmarks/bench_spec.py [--threads 1] [--max-tokens 128] [--methods none,ngram,self,draft]
GPU: python benchmarks/bench_spec.py --device cuda --methods none,ngram,self --modes b1,b8 --reps 2
Writes benchmarks/results/spec_<device>.json and prints a table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

PARAGRAPH = ("The city library opened in 1952 and quickly became the heart of the neighbourhood. Every "
             "Saturday morning, children gathered in the reading room to listen to stories, while their "
             "parents browsed the new arrivals. In 1987 the building was expanded with a second floor that "
             "holds the music collection and a small café. Today the library lends more than two hundred "
             "thousand items a year and runs free classes on computers, languages and gardening.")
TYPOS = ("Teh city libary opened in 1952 and quikly became the hart of the neighbourhood. Every Saturday "
         "morning, childern gathered in the reading room to listen to storys, while there parents browsed "
         "the new arivals. In 1987 the bilding was expanded with a secnd floor.")
CODE = '''def summarize(data, limit=10):
    """Return the count, mean and the largest values of data."""
    if not data:
        return {"count": 0, "mean": None, "top": []}
    total = 0
    for value in data:
        total += value
    mean = total / len(data)
    top = sorted(data, reverse=True)[:limit]
    return {"count": len(data), "mean": mean, "top": top}
'''
WORKLOADS = {
    "rewrite": [
        f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}",
        f"Fix the spelling mistakes in this text and output the corrected text in full:\n\n{TYPOS}",
        f"Rename the parameter `data` to `values` in this Python function and output the complete "
        f"updated code:\n\n```python\n{CODE}```",
        f"Summarize the following text in three sentences, reusing its wording:\n\n{PARAGRAPH}",
        f"Copy this function exactly, then add a one-line comment above it:\n\n```python\n{CODE}```",
        f"Repeat this text twice, separated by a blank line:\n\n{PARAGRAPH}",
        f"Correct the typos and repeat the text:\n\n{TYPOS}",
        f"Add type hints to this function and output the full code:\n\n```python\n{CODE}```",
    ],
    "chat": [
        "What are three good habits for sleeping better? Explain each one.",
        "Write a short story about a robot who learns to paint.",
        "Explain how a bicycle works to a ten-year-old.",
        "What should I pack for a weekend hiking trip in the mountains?",
        "Give me five ideas for a birthday party for a seven-year-old.",
        "Why is the sky blue? Answer in a short paragraph.",
        "Describe the water cycle in simple words.",
        "What are the pros and cons of working from home?",
    ],
}


def truncated_draft(num_layers: int) -> str:
    """SmolLM2-135M-Instruct cut to its first num_layers layers, saved as a standalone model folder."""
    from safetensors.torch import load_file, save_file

    from engine.models.bundled import ensure_bundled
    src = ensure_bundled()
    dst = src.parent / f"{src.name}-first{num_layers}"
    if (dst / "model.safetensors").exists():
        return str(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = num_layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    keep = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        keep[name] = t.contiguous()
    save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "special_tokens_map.json"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return str(dst)


def token_prompts(workload: str, vocab: int, n: int = 4) -> list[list[int]]:
    """For tokenizer-less random-weight models (GPU runs): 'rewrite' prompts hold a random passage twice,
    'chat' prompts are random. With random weights acceptance is an artifact of the weights; such rows
    measure what drafting and verification cost, not what they buy on real text."""
    import random
    rng = random.Random(0)
    out = []
    for _ in range(n):
        body = [rng.randrange(10, vocab) for _ in range(200)]
        out.append(body + body[:50] if workload == "rewrite" else body)
    return out


SHADOW_FLAGS = ("main", "everyblock", "noeveryblock", "confirm", "noconfirm", "prefetch", "noprefetch")


def set_shadow_flags(d, flags: list[str]) -> None:
    """Per-run switches of one engine's drafter: '+main' = every_block, confirm and prefetch off, '+X' / '+noX'."""
    cfg = d.engine.config
    for attr, name, default in (("every_block", "everyblock", cfg.speculative_config.spec_shadow_every_block),
                                ("confirm", "confirm", cfg.speculative_config.spec_shadow_confirm),
                                ("prefetch_prompts", "prefetch", cfg.speculative_config.spec_prefetch)):
        on = False if "main" in flags else default
        setattr(d, attr, (on or name in flags) and f"no{name}" not in flags)


def switch_drafter(eng, flags: list[str]) -> None:
    """One engine's drafter set for a run of a method with these '+' flags (see the module doc)."""
    d, cfg = eng.drafter, eng.config
    if d is None:
        return
    d.auto_off = cfg.speculative_config.speculative_auto_off and "noauto" not in flags
    eng.fast_verify.enabled = cfg.speculative_config.spec_fast_verify and "general" not in flags
    d.shadow_probes = cfg.speculative_config.spec_shadow_probes and d.supports_shadow and "noshadow" not in flags
    d.k = cfg.speculative_config.max_speculative_tokens if "long" in flags else d.k_base
    set_shadow_flags(d, flags)


def run_mode(llm: LLM, prompts: list[str], mode: str, sp: SamplingParams):
    eng = llm.engine
    if eng.tokenizer is None or not getattr(eng.tokenizer, "chat_template", None):
        name = "rewrite" if prompts is WORKLOADS["rewrite"] else "chat"
        texts = token_prompts(name, eng.arch_config.vocab_size, len(prompts))
    else:
        texts = [eng.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    t0 = time.perf_counter()
    if mode == "b1":
        outs = [llm.generate([t], sp, use_tqdm=False)[0] for t in texts[:4]]
    else:
        n = int(mode[1:])
        outs = llm.generate([texts[i % len(texts)] for i in range(n)], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    return outs, wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="none,ngram,self,draft",
                    help="a '+noauto' suffix turns auto-off off (Drafter.auto_off); more '+' flags in the module doc")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine max_num_seqs (fewer CUDA graphs)")
    ap.add_argument("--modes", default="b1,b4")
    ap.add_argument("--workloads", default="rewrite,chat")
    ap.add_argument("--k-ngram", type=int, default=4)
    ap.add_argument("--k-long", type=int, default=8, help="'+long': num_speculative_tokens_max")
    ap.add_argument("--k-self", type=int, default=2)
    ap.add_argument("--self-layers", type=int, default=24)
    ap.add_argument("--k-draft", type=int, default=2)
    ap.add_argument("--draft-layers", type=int, default=16, help="layers kept in the truncated draft model")
    ap.add_argument("--draft-model", default=None, help="default: SmolLM2 truncated to --draft-layers layers")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=1,
                    help="interleaved repetitions; the fastest run of each method is kept (GPU: >= 2, "
                         "the first pays Triton compiles / graph captures)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    methods = {
        "none": {},
        "ngram": dict(speculative_method="ngram", num_speculative_tokens=args.k_ngram, ngram_min=1, ngram_max=4),
        "self": dict(speculative_method="self", num_speculative_tokens=args.k_self, draft_layers=args.self_layers),
        "draft": dict(speculative_method="draft", num_speculative_tokens=args.k_draft),
    }
    labels = {"none": "none", "ngram": f"ngram k={args.k_ngram}",
              "self": f"self L={args.self_layers} k={args.k_self}",
              "draft": (f"draft {args.draft_model} k={args.k_draft}" if args.draft_model
                        else f"draft {args.draft_layers}-layer k={args.k_draft}")}
    chosen = args.methods.split(",")
    if any(m.startswith("draft") for m in chosen) and args.draft_model:
        methods["draft"]["draft_model"] = args.draft_model
    elif any(m.startswith("draft") for m in chosen):
        methods["draft"]["draft_model"] = truncated_draft(args.draft_layers)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    # one engine per drafter, all loaded up front; runs are interleaved method by method for each
    # (workload, mode) so that load from other processes on a shared machine hits all methods alike
    engines = {}
    extra = {} if args.max_num_seqs is None else dict(max_num_seqs=args.max_num_seqs)
    def parse(method: str) -> tuple[str, bool, bool]:
        """'ngram+noauto+eager' -> ('ngram', noauto, eager); '+general': see the module doc"""
        parts = method.split("+")
        return parts[0], "noauto" in parts[1:], "eager" in parts[1:]

    long_k = {parse(m)[0] for m in chosen if "long" in m.split("+")[1:]}
    for method in chosen:
        base, _, eager = parse(method)
        if (base, eager) not in engines:
            cfg = dict(methods[base], **({"spec_cuda_graphs": False} if eager else {}))
            if base in long_k:          # one engine for both: '+long' switches the long drafts on per run
                cfg["num_speculative_tokens_max"] = args.k_long
            llm = LLM(model=args.model, device=args.device, dtype=args.dtype, cpu_kv_cache_gib=0.25,
                      max_model_len=2048, gpu_memory_utilization=0.3, **extra, **cfg)
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_tqdm=False)    # warm-up
            engines[(base, eager)] = llm
    rows, baseline = [], {}
    load0 = os.getloadavg()
    best: dict = {}
    for wl, mode, rep in itertools.product(args.workloads.split(","), args.modes.split(","), range(args.reps)):
        for method in chosen:
            base, noauto, eager = parse(method)
            llm = engines[(base, eager)]
            eng = llm.engine
            switch_drafter(eng, method.split("+")[1:])
            before = eng.drafter.total_stats() if eng.drafter else None
            outs, wall = run_mode(llm, WORKLOADS[wl], mode, sp)
            ntok = sum(len(o.token_ids) for o in outs)
            label = labels[base] + (" no-auto-off" if noauto else "") + \
                (" eager-verify" if eager else "") + (" general-verify" if "general" in method.split("+") else "") + \
                (" no-shadow-probes" if "noshadow" in method.split("+") else "") + \
                (f" long<={args.k_long}" if "long" in method.split("+") else "") + \
                "".join(f" {f}" for f in method.split("+")[1:] if f in SHADOW_FLAGS)
            row = dict(workload=wl, mode=mode, method=label, out_tokens=ntok, wall_s=wall,
                       tok_s=ntok / wall,
                       tpot_ms=1e3 * sum(o.tpot or 0 for o in outs) / len(outs),
                       ttft_ms=1e3 * sum(o.ttft or 0 for o in outs) / len(outs),
                       loadavg_1m=os.getloadavg()[0])
            key = (wl, mode)
            toks = [o.token_ids for o in outs]
            if method == "none":
                baseline[key] = toks
            if key in baseline:
                row["identical"] = toks == baseline[key]
            if eng.drafter:
                after = eng.drafter.total_stats()
                d = {k: after[k] - before[k] for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                       "spec_decode_num_accepted_tokens")}
                row["drafts"] = d["spec_decode_num_drafts"]
                row["draft_tokens"] = d["spec_decode_num_draft_tokens"]
                row["accept_rate"] = (d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_draft_tokens"]
                                      if d["spec_decode_num_draft_tokens"] else None)
                row["mean_len"] = (1 + d["spec_decode_num_accepted_tokens"] / d["spec_decode_num_drafts"]
                                   if d["spec_decode_num_drafts"] else None)
                row["per_pos"] = [a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                                         before["spec_decode_num_accepted_tokens_per_pos"])]
            row["rep"] = rep
            bk = (wl, mode, method)
            if bk not in best or row["tok_s"] > best[bk]["tok_s"]:
                best[bk] = row
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                  flush=True)
    for (wl, mode, method), row in best.items():
        base_row = best.get((wl, mode, "none"))
        if base_row:
            row["speedup"] = row["tok_s"] / base_row["tok_s"]
        rows.append(row)
    dev = device_name(args.device)
    payload = dict(device=dev, model=args.model or "SmolLM2-135M-Instruct (bundled)", dtype=args.dtype,
                   torch_threads=torch.get_num_threads(), loadavg_before=load0, loadavg_after=os.getloadavg(),
                   max_tokens=args.max_tokens, greedy=True, args=vars(args), rows=rows)
    path = write_json(f"spec_{slug(dev)}{args.tag}", payload)
    print()
    print_table(rows, ["workload", "mode", "method", "out_tokens", "tok_s", "speedup", "accept_rate",
                       "mean_len", "draft_tokens", "tpot_ms", "ttft_ms", "identical"])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
