"""Accuracy of the quantized CPU path (int4 groups of 32 and an int4 LM head on torch's CPU int4 GEMM) against fp32 on the bundled
SmolLM2: for 6 held-out chat prompts, whether 32 greedy tokens are identical, and the mean per-token
KL(fp32 || quantized) of next-token distributions along fp32's greedy tokens (prompt prefilled, then one-token decode
steps: the decode path the engine runs). Prints a table, writes benchmarks/results/cpu_quant_accuracy.json.

    python benchmarks/check_cpu_quant.py [--tokens 32] [--decode-layer on|off]

--decode-layer: the quantized model's decode steps on kvscope::decode_layer (one C++ call a layer, the engine's
default) or on the layer's torch ops.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, print_table, write_json  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain photosynthesis to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "What is the difference between a list and a tuple in Python?",
    "How do I boil an egg?",
]


def md(start: int, n: int, bs: int = 16):
    """One sequence computing positions [start, start + n) in blocks 1, 2, ...; logits for the last position."""
    from engine.kernels.metadata import AttentionMetadata
    end = start + n
    return AttentionMetadata(positions=torch.arange(start, end), slot_mapping=torch.arange(bs + start, bs + end),
                             cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([end], dtype=torch.int32),
                             block_tables=torch.arange(1, -(-end // bs) + 1, dtype=torch.int32)[None],
                             logits_indices=torch.tensor([n - 1]), q_lens=[n], seq_lens_cpu=[end], max_seqlen_q=n,
                             max_seqlen_k=end, block_size=bs)


@torch.inference_mode()
def run(model, prompt: list[int], tokens: int, follow: list[int] | None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (or, with follow, the tokens given) and each step's log-probabilities."""
    c, bs = model.cfg, 16
    nb = -(-(len(prompt) + tokens) // bs) + 2
    kv = torch.zeros(2, c.num_layers, nb, bs, c.num_kv_heads, c.head_dim)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0, i], kv[1, i]
    out, lps = [], []
    x, pos = torch.tensor(prompt), 0
    for i in range(tokens):
        h = model(x, md(pos, len(x)))
        lp = model.compute_logits(h[-1:])[0].log_softmax(-1)
        lps.append(lp)
        t = follow[i] if follow is not None else int(lp.argmax())
        out.append(int(lp.argmax()))
        pos += len(x)
        x = torch.tensor([t])
    return out, lps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quantization", default="int4")
    ap.add_argument("--group", type=int, default=32, help="int4 group size")
    ap.add_argument("--decode-layer", choices=["on", "off"], default="on",
                    help="decode steps on kvscope::decode_layer (the engine's default) or the layer's torch ops")
    args = ap.parse_args()
    from engine.kernels.ops import get_ops
    from engine.models.loader import build_model, load_tokenizer, resolve
    hf_cfg, folder, tok_folder = resolve(None)
    tok = load_tokenizer(tok_folder)
    ops, cpu = get_ops("torch"), torch.device("cpu")
    ref = build_model(hf_cfg, folder, ops, cpu, torch.float32, max_pos=1024, seed=0)
    q = build_model(hf_cfg, folder, ops, cpu, torch.float32, max_pos=1024, seed=0, quantization=args.quantization,
                    int4_group_size=args.group)
    q.cpu_decode_layer = args.decode_layer == "on"
    rows = []
    for text in PROMPTS:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(chat, add_special_tokens=False)
        want, ref_lps = run(ref, ids, args.tokens, None)
        greedy, _ = run(q, ids, args.tokens, None)
        _, q_lps = run(q, ids, args.tokens, want)                 # teacher-forced on fp32's tokens
        kl = [float((a.exp() * (a - b)).sum()) for a, b in zip(ref_lps, q_lps)]
        first = next((i for i, (a, b) in enumerate(zip(want, greedy)) if a != b), None)
        rows.append({"prompt": text[:40], "identical": greedy == want, "first diff": first,
                     "mean KL": sum(kl) / len(kl), "max KL": max(kl)})
    print_table(rows, ["prompt", "identical", "first diff", "mean KL", "max KL"])
    same = sum(r["identical"] for r in rows)
    mean_kl = sum(r["mean KL"] for r in rows) / len(rows)
    print(f"{args.quantization}: {same} of {len(rows)} prompts identical over {args.tokens} tokens; "
          f"mean per-token KL {mean_kl:.5f}; decode steps on kvscope::decode_layer: {q.decode_layer_steps}")
    path = write_json("cpu_quant_accuracy", {"device": device_name("cpu"), "quantization": args.quantization, "group": args.group,
                                             "tokens": args.tokens, "identical": same, "mean_kl": mean_kl,
                                             "decode_layer": args.decode_layer,
                                             "decode_layer_steps": q.decode_layer_steps, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
