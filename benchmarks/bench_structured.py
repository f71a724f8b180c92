"""Per-token cost of structured output: decode steps of a full batch, constraints off vs on.

For each batch size B, the same B prompts decode max_tokens tokens, once unconstrained (ignore_eos) and once
each constrained to a typical JSON schema (a user record: strings, an integer range, an enum, an array).
A request's grammar may end it before max_tokens, so only steps where all B requests are decoding count:
ms/token = their wall time / the tokens they produced. "mask ms/step" is the host time spent filling and
applying the bitmasks (on CUDA it overlaps the forward in flight). Overhead = on / off - 1.

    python benchmarks/bench_structured.py [--model dummy:llama-3.2-1b] [--batch-sizes 1 32]
        [--num-scheduler-steps 8] [--structured-overlap on|off] [--structured-multi-step on|off]
        [--mask-threads N] [--fused-token-bitmask on|off]

--num-scheduler-steps 8 (the CUDA default) compares constrained decoding against unconstrained multi-step
decoding; 1 against single steps. The JSON's name carries the settings that differ from the defaults.

Random-weight presets borrow SmolLM2's tokenizer from ~/.cache/kvscope/smollm2-135m-instruct; on a machine
without it pass --tokenizer-dir with a copy of that folder's tokenizer files (see the README).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, slug, write_json  # noqa: E402
from engine import LLMEngine, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "email", "age", "role", "skills", "bio"],
    "properties": {
        "name": {"type": "string"}, "email": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "bio": {"type": "string"},
    },
}
PROMPT = "Write a JSON record for a new user of our website, with a long bio."


def install_tokenizer(src: Path) -> None:
    """Random-weight presets read SmolLM2's tokenizer from the bundled model's cache folder."""
    from engine.models.bundled import DEFAULT_CACHE
    if (DEFAULT_CACHE / "tokenizer.json").exists():
        return
    DEFAULT_CACHE.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, DEFAULT_CACHE / f.name)


def timed_grammar(eng: LLMEngine) -> list[float]:
    """Time the engine's StructuredOutputManager.apply per call (host side: fill and apply the masks, in single
    steps and grammar blocks alike)."""
    spent: list[float] = []

    def timed(inner):
        def wrapped(*a):
            t = time.perf_counter()
            inner(*a)
            spent.append(time.perf_counter() - t)
        return wrapped
    eng.structured.apply = timed(eng.structured.apply)
    return spent


def run_once(eng: LLMEngine, B: int, max_tokens: int, constrained: bool, spent: list[float]) -> dict:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=not constrained, structured_outputs=so)
    ids = [eng.add_request(PROMPT, sp) for _ in range(B)]
    out_len = {i: 0 for i in ids}
    step_s, step_tok, mask_s = 0.0, 0, 0.0
    while eng.has_unfinished_requests():
        full = len(eng.scheduler.running) == B and all(n > 0 for n in out_len.values())
        n_spent = len(spent)
        t = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t
        toks = 0
        for o in outs:
            toks += len(o.delta_token_ids)
            out_len[o.request_id] = len(o.token_ids)
        if full and toks and toks % B == 0 and not any(o.finished for o in outs):
            step_s += dt
            step_tok += toks
            mask_s += sum(spent[n_spent:])
    steps = step_tok / B if step_tok else 0
    return dict(ms_per_token=1e3 * step_s / max(step_tok, 1), steps=steps,
                mask_ms_per_step=1e3 * mask_s / steps if steps else 0.0,
                mean_output_tokens=statistics.mean(out_len.values()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: bundled SmolLM2 on CPU, dummy:llama-3.2-1b on CUDA")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 128 on CUDA, 48 on CPU")
    ap.add_argument("--repeats", type=int, default=None, help="rounds per mode, median kept (default 5 CUDA, 2 CPU)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="1 (default) compares single steps with constrained decoding; 8 (the CUDA default) "
                         "compares unconstrained multi-step blocks with it")
    ap.add_argument("--structured-overlap", choices=["auto", "on", "off"], default="auto",
                    help="EngineConfig.structured_overlap (auto: on with CUDA)")
    ap.add_argument("--structured-multi-step", choices=["on", "off"], default="on",
                    help="EngineConfig.structured_multi_step (grammar blocks of up to num_scheduler_steps iterations)")
    ap.add_argument("--mask-threads", type=int, default=None,
                    help="EngineConfig.structured_mask_threads (default: the engine's; 0: llguidance's default)")
    ap.add_argument("--fused-token-bitmask", choices=["on", "off"], default="on",
                    help="EngineConfig.fused_token_bitmask (the Triton kernel; used with triton kernels)")
    ap.add_argument("--tokenizer-dir", type=Path, default=None,
                    help="a folder with SmolLM2's tokenizer files, for random-weight presets on a bare machine")
    args = ap.parse_args()
    import torch
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    model = args.model or ("dummy:llama-3.2-1b" if gpu else None)
    if args.tokenizer_dir is not None:
        install_tokenizer(args.tokenizer_dir)
    max_tokens = args.max_tokens or (128 if gpu else 48)
    repeats = args.repeats or (5 if gpu else 2)
    overlap = {"auto": None, "on": True, "off": False}[args.structured_overlap]
    eng = LLMEngine(model=model, device=device, num_scheduler_steps=args.num_scheduler_steps,
                    max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False,
                    structured_overlap=overlap, fused_token_bitmask=args.fused_token_bitmask == "on",
                    structured_multi_step=args.structured_multi_step == "on",
                    **({} if args.mask_threads is None else {"structured_mask_threads": args.mask_threads or None}),
                    **({} if gpu else {"cpu_kv_cache_gib": 0.5}))
    if eng.tokenizer is None:
        sys.exit("this model has no tokenizer: pass --tokenizer-dir (a copy of SmolLM2's tokenizer files)")
    spent = timed_grammar(eng)
    eng.add_request(PROMPT, SamplingParams(max_tokens=2, structured_outputs={"json": SCHEMA}))   # compile, warm up
    while eng.has_unfinished_requests():
        eng.step()
    rows = []
    for B in args.batch_sizes:
        res = {}
        for mode in ("off", "on"):
            runs = [run_once(eng, B, max_tokens, mode == "on", spent) for _ in range(repeats)]
            runs.sort(key=lambda r: r["ms_per_token"])
            res[mode] = runs[len(runs) // 2]
        for mode in ("off", "on"):
            r = res[mode]
            rows.append(dict(batch=B, constraints=mode, ms_per_token=r["ms_per_token"],
                             tok_s=1e3 / r["ms_per_token"] if r["ms_per_token"] else 0.0,
                             mask_ms_per_step=r["mask_ms_per_step"], full_batch_steps=r["steps"],
                             mean_output_tokens=r["mean_output_tokens"],
                             overhead_pct=100 * (r["ms_per_token"] / res["off"]["ms_per_token"] - 1)))
    dev = device_name(device)
    name = model or "SmolLM2-135M-Instruct"
    tag = "".join([f"_k{args.num_scheduler_steps}" if args.num_scheduler_steps != 1 else "",
                   f"_overlap-{args.structured_overlap}" if args.structured_overlap != "auto" else "",
                   "_single-grammar-steps" if args.structured_multi_step == "off" else "",
                   f"_threads{args.mask_threads}" if args.mask_threads is not None else "",
                   "_torch-mask" if args.fused_token_bitmask == "off" else ""])
    settings = dict(num_scheduler_steps=args.num_scheduler_steps, structured_overlap=eng.structured_overlap,
                    structured_multi_step=args.structured_multi_step == "on",
                    structured_mask_threads=eng.config.structured_output_config.structured_mask_threads,
                    fused_token_bitmask=eng.structured.bitmask.fused if eng.structured.bitmask is not None else None,
                    kernels=eng.kernels)
    path = write_json(f"structured_{slug(dev)}{tag}", dict(device=dev, model=name, max_tokens=max_tokens,
                                                            repeats=repeats, **settings, schema=SCHEMA, rows=rows))
    print(f"\ndevice: {dev}; model: {name}; max_tokens {max_tokens}; median of {repeats}; {settings}; json: {path}")
    print_table(rows, ["batch", "constraints", "ms_per_token", "tok_s", "mask_ms_per_step", "overhead_pct",
                       "full_batch_steps", "mean_output_tokens"])


if __name__ == "__main__":
    main()
