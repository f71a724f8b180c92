"""Continuous vs static batching: a static batch runs until its longest request finishes, so short requests'
slots idle and the queue waits; continuous batching refills a slot the step it frees."""
from __future__ import annotations

import numpy as np

from inspector.lessons.common import Setup, close, greedy, kv_pool, random_prompts, result, run

TITLE = "Continuous vs static batching"
WHAT = ("The same requests with mixed output lengths: continuous batching admits a waiting request as soon as a "
        "slot frees, so requests start sooner (TTFT) and the batch stays full (throughput).")


def run_lesson(setup: Setup, num_requests: int | None = None, max_num_seqs: int | None = None,
               output_range: tuple[int, int] | None = None, prompt_range: tuple[int, int] = (16, 64)) -> dict:
    large = setup.large
    n = num_requests or (256 if large else 24)
    seqs = max_num_seqs or (32 if large else 4)
    lo, hi = output_range or ((16, 512) if large else (4, 48))
    rng = np.random.default_rng(setup.seed)
    outs = rng.integers(lo, hi + 1, n).tolist()
    max_len = prompt_range[1] + hi + 1
    series, summary = {}, {}
    for mode in ("continuous", "static"):
        eng = setup.engine(scheduling=mode, max_num_seqs=seqs, max_model_len=max_len, enable_prefix_caching=False,
                           **kv_pool(seqs, max_len))
        prompts = random_prompts(n, prompt_range, eng.arch_config.vocab_size, setup.seed)
        r = run(eng, prompts, [greedy(k) for k in outs])
        done = sorted(r.outputs.values(), key=lambda o: int(o.request_id.split("-")[1]))
        ttft = [o.metrics.ttft for o in done]
        series[mode] = dict(ttft_s=ttft, output_tok_s=r.output_tokens / r.wall, wall_s=r.wall,
                            mean_ttft_s=float(np.mean(ttft)), p90_ttft_s=float(np.percentile(ttft, 90)))
        model = eng
        close(eng)
    c, s = series["continuous"], series["static"]
    summary = dict(throughput_ratio=c["output_tok_s"] / s["output_tok_s"], mean_ttft_ratio=s["mean_ttft_s"] / c["mean_ttft_s"],
                   continuous_tok_s=c["output_tok_s"], static_tok_s=s["output_tok_s"])
    return result("batching", TITLE, WHAT, model, series, summary, num_requests=n, max_num_seqs=seqs,
                  output_range=[lo, hi], prompt_range=list(prompt_range))
