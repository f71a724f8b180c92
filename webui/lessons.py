"""Lessons tab: one button per lesson (inspector.lessons) runs it on the engine's model and device and draws it."""
from __future__ import annotations

import logging
import time

import gradio as gr

from inspector import figures as F
from inspector.lessons import LESSONS, Setup, run_lesson
from webui.host import EngineHost
from webui.render import spec_plot

log = logging.getLogger("kvscope.app")


def _summary_md(res: dict, seconds: float) -> str:
    rows = "\n".join(f"| {k} | {v:,.3g} |" if isinstance(v, float) else f"| {k} | {v} |"
                     for k, v in res["summary"].items() if v is not None)
    return (f"**{res['title']}** · {res['model']} on {res['device']} ({res['dtype']}) · ran in {seconds:.1f} s\n\n"
            f"{res['what']}\n\n| measured | value |\n|---|---|\n{rows}")


def lessons_tab(host: EngineHost) -> None:
    with gr.Tab("Lessons", id="lessons"):
        gr.Markdown("Why vLLM-style serving is fast, measured here: each button runs a seeded experiment with fresh "
                    "engines (their own small KV pools) and draws it. *small* sweeps take seconds with `dummy:tiny` "
                    "and a minute or two with SmolLM2 on a CPU; *large* is the GPU sweep (batches to 512). The same "
                    "runs as a script: `python benchmarks/lessons.py`.")
        with gr.Row():
            which = gr.Radio(["engine's model", "dummy:tiny (fast)"], value="engine's model", label="model", scale=2)
            scale = gr.Radio(["auto", "small", "large"], value="auto", label="sweep size (auto: large on a GPU)",
                             scale=2)
        with gr.Row():
            buttons = {name: gr.Button(mod.TITLE, elem_id=f"kv-lesson-{name}") for name, mod in LESSONS.items()}
        msg = gr.Markdown(elem_id="kv-lesson-msg")
        chart = gr.Plot(value=spec_plot(F.lesson_spec(None)), show_label=False, elem_id="kv-plot-lesson")

        def run_fn(name, model_choice, sweep):
            cfg = host.config
            model = "dummy:tiny" if model_choice.startswith("dummy") else cfg.model_config.model
            setup = Setup(model=model, device=cfg.model_config.device, dtype=cfg.model_config.dtype,
                          seed=cfg.model_config.seed, scale=sweep)
            t0 = time.perf_counter()
            try:
                res = run_lesson(name, setup)
            except Exception as e:          # a failed lesson reports itself; the app keeps serving
                log.exception("lesson %s failed", name)
                return f"⚠️ {LESSONS[name].TITLE} failed: {type(e).__name__}: {e}", gr.skip()
            return _summary_md(res, time.perf_counter() - t0), spec_plot(F.lesson_spec(res))

        for name, btn in buttons.items():
            btn.click(lambda m, s, n=name: run_fn(n, m, s), [which, scale], [msg, chart], concurrency_limit=1,
                      api_name=f"lesson_{name}")
