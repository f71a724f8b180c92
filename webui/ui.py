"""The Gradio Blocks: a status line over the tabs; each tab lives in its own module."""
from __future__ import annotations

import gradio as gr

from webui.host import EngineHost
from webui.inspector import inspector_tab
from webui.lessons import lessons_tab
from webui.load import load_tab
from webui.playground import playground_tab
from webui.settings import compare_tab, export_tab, settings_tab

CSS = """
.kv-progress {font-size: 14px; padding: 4px 0;}
.kv-bar {height: 10px; background: #eef0f3; border-radius: 5px; overflow: hidden; margin-bottom: 6px;}
.kv-bar > div {height: 100%; background: #4E79A7; transition: width .4s;}
.kv-progress[data-state=done] .kv-bar > div {background: #59A14F;}
.kv-progress[data-state=stopped] .kv-bar > div {background: #E15759;}
.kv-err {color: #b00020; font-size: 12px; margin-top: 4px;}
#kv-status {font-size: 13px;}
#kv-req-stats table {display: block; overflow-x: auto;}
#kv-req-stats th {white-space: nowrap; word-break: keep-all; overflow-wrap: normal;}
footer {display: none !important;}
"""


def build_ui(host: EngineHost):
    with gr.Blocks(title="kvscope — an LLM engine you can see into") as demo:
        gr.Markdown("## kvscope · an LLM inference engine you can see into\n"
                    "Paged KV cache, continuous batching, chunked prefill, preemption and prefix caching — "
                    "send prompts, launch simulated users, and watch the engine's blocks and steps live in "
                    "the **Inspector**.")
        status = gr.Markdown(host.status_line(), elem_id="kv-status")
        status_timer = gr.Timer(2.0)
        status_timer.tick(lambda: host.status_line(), None, status, concurrency_limit=None, show_progress="hidden",
                          queue=False, api_visibility="private")
        playground_tab(host)
        load_tab(host, demo)
        inspector_tab(host)
        settings_tab(host)
        compare_tab(host)
        lessons_tab(host)
        export_tab(host)
    return demo
