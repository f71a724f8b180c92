"""Load tab: simulated users against the in-process engine or an OpenAI-compatible HTTP server."""
from __future__ import annotations

import math

import gradio as gr

from inspector import load as L
from inspector import metrics as M
from webui.forms import make_http_runner, make_load_spec, make_slo
from webui.host import EngineHost, EngineUnavailable, max_model_len
from webui.render import progress_html, summary_md


def load_tab(host: EngineHost, demo: gr.Blocks) -> None:
    with gr.Tab("Load", id="load"):
        gr.Markdown("Simulated users drive the engine in-process through the same `submit()` API the playground "
                    "uses, or — target **HTTP** — send the same workload as streaming `/v1/completions` to this "
                    "server's OpenAI-compatible API or any other (e.g. vLLM), timing TTFT/ITL over the wire. Arrivals are gamma distributed (shape = burstiness, scale = 1 / (rate · burstiness); "
                    "1 = Poisson) as in `vllm bench serve`. Prompts are random token ids of the chosen lengths, or chat-templated "
                    "text from a small bundled set; "
                    "outputs are greedy with EOS ignored, so lengths are exact.")
        spec0 = L.preset("Steady Poisson", host.engine_info(measure=False))
        with gr.Row():
            preset_dd = gr.Dropdown(list(L.PRESETS), value="Steady Poisson", label="Preset", scale=2,
                                    elem_id="kv-preset")
            preset_md = gr.Markdown(spec0.description, elem_id="kv-preset-md")
        with gr.Row():
            n_req = gr.Number(value=spec0.num_requests, precision=0, label="number of requests", elem_id="kv-nreq")
            rate = gr.Number(value=spec0.rate, label="rate (requests/s)", elem_id="kv-rate")
            burst_all = gr.Checkbox(value=False, label="all at once (rate = ∞)")
            burstiness = gr.Number(value=1.0, label="burstiness (gamma shape; 1 = Poisson)")
            conc = gr.Number(value=0, precision=0, label="max concurrency (0 = unlimited)")
        with gr.Row():
            p_kind = gr.Dropdown(list(L.LENGTH_KINDS), value="uniform", label="prompt length distribution")
            p_min = gr.Number(value=spec0.prompt_len.low, precision=0, label="prompt min tokens", elem_id="kv-pmin")
            p_max = gr.Number(value=spec0.prompt_len.high, precision=0, label="prompt max tokens", elem_id="kv-pmax")
            o_kind = gr.Dropdown(list(L.LENGTH_KINDS), value="uniform", label="output length distribution")
            o_min = gr.Number(value=spec0.output_len.low, precision=0, label="output min tokens", elem_id="kv-omin")
            o_max = gr.Number(value=spec0.output_len.high, precision=0, label="output max tokens", elem_id="kv-omax")
        with gr.Accordion("More knobs and SLOs", open=False):
            with gr.Row():
                shared = gr.Number(value=0, precision=0, label="shared system-prompt tokens")
                turns = gr.Number(value=1, precision=0, label="turns per user (multi-turn)")
                think = gr.Number(value=0.0, label="think time between turns (s)")
                load_seed = gr.Number(value=0, precision=0, label="seed")
                load_temp = gr.Number(value=0.0, label="temperature")
                load_ieos = gr.Checkbox(value=True, label="ignore EOS (exact output lengths)")
                prompts = gr.Radio(list(L.PROMPT_SOURCES), value="random ids", label="prompts",
                                   info="text: chat-templated prompts from a small bundled text set (in-process)")
            with gr.Row():
                slo_ttft = gr.Number(value=None, label="TTFT SLO (ms, empty = none)", placeholder="none")
                slo_tpot = gr.Number(value=None, label="TPOT SLO (ms)", placeholder="none")
                slo_e2el = gr.Number(value=None, label="E2EL SLO (ms)", placeholder="none")
                fresh = gr.Checkbox(value=True, label="clear the inspector's history at start")
        with gr.Row():
            target = gr.Radio(["in-process engine", "HTTP (OpenAI-compatible)"], value="in-process engine",
                              label="target", scale=2, elem_id="kv-target",
                              info="HTTP sends streaming /v1/completions with token-id prompts")
            t_url = gr.Textbox(value="", label="HTTP base URL (empty = this server)", scale=2,
                               placeholder="http://127.0.0.1:8000/v1", elem_id="kv-target-url")
            t_model = gr.Textbox(value="", label="model (empty = the server's first)", scale=1)
            t_key = gr.Textbox(value="", label="API key (optional)", type="password", scale=1)
        with gr.Row():
            start_btn = gr.Button("Start load", variant="primary", elem_id="kv-start-load")
            stop_btn = gr.Button("Stop load", variant="stop", elem_id="kv-stop-load")
        load_msg = gr.Markdown(elem_id="kv-load-msg")
        prog = gr.HTML(progress_html(None), elem_id="kv-progress")
        summ_md = gr.Markdown(elem_id="kv-summary-md")
        summ = gr.Dataframe(headers=["Metric", "Mean", "P50", "P90", "P99", "N", "Definition"],
                            label="Summary (latencies in ms; computed from the engine's RequestMetrics stamps)",
                            interactive=False, wrap=True, elem_id="kv-summary",
                            column_widths=["17%", "9%", "8%", "8%", "8%", "9%", "41%"])
        load_knobs = [n_req, rate, burst_all, burstiness, conc, p_kind, p_min, p_max, o_kind, o_min, o_max,
                      shared, turns, think, load_seed, load_temp, load_ieos]

        def preset_fn(name):
            try:
                s = L.preset(name, host.engine_info())
            except Exception as e:
                raise gr.Error(str(e))
            inf = math.isinf(s.rate)
            return (s.description, s.num_requests, (s.rate if not inf else 8.0), inf, s.burstiness, s.max_concurrency or 0,
                    s.prompt_len.kind, s.prompt_len.low, s.prompt_len.high, s.output_len.kind, s.output_len.low,
                    s.output_len.high, s.shared_prefix_len, s.num_turns, s.think_time_s, s.seed, s.temperature,
                    s.ignore_eos)

        preset_dd.change(preset_fn, preset_dd, [preset_md, *load_knobs], api_name="preset", queue=False)
        # the first page load measures the engine's capacity (seconds on a CPU, once per engine) and resizes
        # the preset shown; later loads reuse the measurement
        demo.load(preset_fn, preset_dd, [preset_md, *load_knobs], api_visibility="private")

        def start_fn(name, *args):
            knobs = args[:len(load_knobs)]
            t1, t2, t3, fr, *tgt = args[len(load_knobs):]
            tgt_kind, url, model, key, source = (list(tgt) + ["in-process engine", "", "", "", "random ids"][len(tgt):])[:5]
            http = str(tgt_kind or "").startswith("HTTP")
            try:
                loop = host.require_loop()
                if host.load is not None and not host.load.done:
                    raise ValueError("a load is already running; stop it first")
                if host.compare is not None and not host.compare.done.is_set():
                    raise ValueError("a comparison is running; wait for it or stop it")
                spec = make_load_spec(name, *knobs, max_model_len=None if http else max_model_len(host),
                                      prompt_source=source)
                slo = make_slo(t1, t2, t3)
                if http:
                    runner = make_http_runner(host, spec, slo, url, model, key)
                else:
                    runner = L.LoadRunner(loop, spec, recorder=host.recorder, slo=slo)
                if fr:
                    host.recorder.clear()
            except (ValueError, EngineUnavailable) as e:
                return f"⚠️ {e}", gr.skip(), gr.skip(), gr.skip()
            host.load = runner.start()
            where = f" → HTTP {runner.target.v1} (model {runner.model})" if http else ""
            return (f"Started **{spec.name}**{where}: {spec.num_requests} requests, "
                    f"{'all at once' if math.isinf(spec.rate) else f'{spec.rate:g} req/s'}, burstiness "
                    f"{spec.burstiness:g}, seed {spec.seed}.", progress_html(runner.progress()), "", None)

        start_btn.click(start_fn, [preset_dd, *load_knobs, slo_ttft, slo_tpot, slo_e2el, fresh, target, t_url,
                                   t_model, t_key, prompts],
                        [load_msg, prog, summ_md, summ], api_name="start_load", concurrency_limit=4)

        def stop_load_fn():
            if host.load is None or host.load.done:
                return "No load is running."
            host.load.stop()
            return "Stopping: in-flight requests are cancelled and their blocks freed."

        stop_btn.click(stop_load_fn, None, load_msg, api_name="stop_load", queue=False)

        def load_status_fn(shown_run):
            r = host.load
            if r is None:
                return gr.skip(), gr.skip(), gr.skip(), shown_run
            p = r.progress()
            if p["done"] and shown_run == r.run_id:
                return gr.skip(), gr.skip(), gr.skip(), shown_run
            if p["done"]:
                s = r.summary()
                return progress_html(p), summary_md(s), M.summary_table(s), r.run_id
            return progress_html(p), gr.skip(), gr.skip(), shown_run

        shown = gr.State(None)
        load_timer = gr.Timer(0.5)
        load_timer.tick(load_status_fn, shown, [prog, summ_md, summ, shown], concurrency_limit=None,
                        show_progress="hidden", api_visibility="private")

        def load_report() -> dict:
            """For API clients: progress and (when done) the summary dict."""
            r = host.load
            if r is None:
                return {"progress": None, "summary": None}
            p = r.progress()
            return {"progress": p, "summary": r.summary() if p["done"] else None}

        gr.api(load_report, api_name="load_report", concurrency_limit=None)
