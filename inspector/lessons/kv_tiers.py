"""KV cache tiers: one oversubscribed burst, at the same KV memory budget, with the pool in the model's dtype or in
fp8, and preempted requests recomputed or swapped to a host tier. fp8 doubles (bf16) the blocks the budget holds,
so fewer requests are preempted; swapping keeps a preempted request's computed tokens."""
from __future__ import annotations

from inspector.lessons.common import Setup, close, greedy, random_prompts, result, run

TITLE = "KV tiers: fp8 KV and swap vs recompute"
WHAT = ("The same burst overflows the same KV memory: an fp8 pool holds more blocks (fewer preemptions), and "
        "swapping a preempted request to host memory copies its blocks back instead of prefilling them again.")


def run_lesson(setup: Setup, num_requests: int | None = None, prompt_len: int | None = None,
               output_len: int | None = None, pool_tokens: int | None = None, offload_gib: float | None = None) -> dict:
    n = num_requests or (64 if setup.large else 8)
    offload_gib = offload_gib or (2.0 if setup.large else 0.05)
    prompt_len = prompt_len or (512 if setup.large else 24)
    output_len = output_len or (256 if setup.large else 16)
    bs = 16
    # the budget: a model-dtype pool of about a third of the burst's tokens (it must preempt)
    base_blocks = max(4, (pool_tokens or n * (prompt_len + output_len) // 3) // bs)
    series, model, elem = {}, None, 1
    for kv in ("auto", "fp8"):
        for mode in ("recompute", "swap"):
            # the same bytes: an fp8 pool holds (bytes of the model dtype) x the blocks
            blocks = base_blocks * (elem if kv == "fp8" else 1) + 1
            eng = setup.engine(kv_cache_dtype=kv, num_kv_blocks=blocks, block_size=bs, enable_prefix_caching=False,
                               max_model_len=prompt_len + output_len + 1, kv_offload_gib=offload_gib,
                               preemption_mode=mode, max_num_seqs=n)
            fmt = str(eng.runner.kv_dtype).replace("torch.", "")
            if kv == "auto":
                elem = eng.runner.kv_cache.element_size()
            r = run(eng, random_prompts(n, prompt_len, eng.arch_config.vocab_size, setup.seed), greedy(output_len))
            ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in r.outputs.values()]
            series[f"{'fp8' if kv == 'fp8' else fmt} · {mode}"] = dict(
                kv_format=fmt, preemption=mode, blocks=blocks - 1, mean_ttft_s=sum(ttft) / len(ttft),
                output_tok_s=r.output_tokens / r.wall, preemptions=eng.scheduler.num_preemptions,
                swaps=eng.scheduler.num_swaps, max_running=r.max_running)
            model = eng
            close(eng)
    arms = list(series)
    best = max(arms, key=lambda a: series[a]["output_tok_s"])
    summary = dict(capacity_ratio=series[arms[2]]["blocks"] / series[arms[0]]["blocks"], best_throughput=best,
                   throughput_ratio=series[best]["output_tok_s"] / series[arms[0]]["output_tok_s"],
                   ttft_ratio=series[arms[0]]["mean_ttft_s"] / series[best]["mean_ttft_s"])
    return result("kv_tiers", TITLE, WHAT, model, series, summary, num_requests=n, prompt_len=prompt_len,
                  output_len=output_len, base_blocks=base_blocks, offload_gib=offload_gib)
