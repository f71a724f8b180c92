"""Engine settings, Compare and Export tabs."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gradio as gr

from inspector import export as X
from inspector import figures as F
from inspector import load as L
from webui.forms import (CHOICES, FIELD_HELP, TRISTATE, config_field_specs, config_form_values, config_from_form,
                         parse_num)
from webui.host import CompareJob, EngineHost, EngineUnavailable
from webui.render import RESIZE_PLOTS_JS, compare_table, spec_plot


def settings_tab(host: EngineHost) -> None:
    with gr.Tab("Engine settings", id="settings"):
        gr.Markdown("Every `EngineConfig` switch. **Apply** validates, stops any running load, and restarts the "
                    "engine with the new settings (the model reloads).")
        fspecs = config_field_specs()
        names = [n for n, _, _ in fspecs]
        comps = []
        cur = config_form_values(host.config, names)
        per_row = 4
        for i in range(0, len(fspecs), per_row):
            with gr.Row():
                for (name, kind, _), val in zip(fspecs[i:i + per_row], cur[i:i + per_row]):
                    info = FIELD_HELP.get(name)
                    if kind == "bool":
                        c = gr.Checkbox(value=bool(val), label=name, info=info)
                    elif kind == "choice":
                        c = gr.Dropdown(CHOICES[name], value=val, label=name, allow_custom_value=(name == "device"),
                                        info=info)
                    elif kind == "opt_bool":
                        c = gr.Dropdown(list(TRISTATE), value=val, label=name, info=info)
                    elif kind in ("int", "opt_int"):
                        c = gr.Number(value=val, precision=0, label=name, info=info,
                                      placeholder="empty = default" if kind == "opt_int" else None)
                    elif kind in ("float", "opt_float"):
                        c = gr.Number(value=val, label=name, info=info,
                                      placeholder="empty = default" if kind == "opt_float" else None)
                    else:
                        c = gr.Textbox(value=val, label=name, info=info)
                    comps.append(c)
        with gr.Row():
            apply_btn = gr.Button("Apply and restart engine", variant="primary", elem_id="kv-apply")
            reset_btn = gr.Button("Show current settings")
        apply_msg = gr.Markdown()

        def apply_fn(*vals):
            try:
                cfg = config_from_form(names, list(vals))
            except ValueError as e:
                return f"⚠️ {e}"
            try:
                return "✅ " + host.restart(cfg)
            except EngineUnavailable as e:
                return f"⚠️ {e}"

        apply_btn.click(apply_fn, comps, apply_msg, api_name="apply_settings", concurrency_limit=1)
        reset_btn.click(lambda: config_form_values(host.config, names), None, comps, api_visibility="private", queue=False)


def compare_tab(host: EngineHost) -> None:
    with gr.Tab("Compare", id="compare") as tab:
        gr.Markdown("Run the **same seeded workload** under two configurations (each on a fresh engine with the "
                    "current model, one after the other) and compare metrics and timelines side by side. "
                    "The main engine keeps serving meanwhile.")
        cmp_fields = [("enable_chunked_prefill", "bool"), ("enable_prefix_caching", "bool"), ("enable_kv_cache", "bool"),
                      ("scheduling", "choice"), ("max_num_batched_tokens", "opt_int"), ("max_num_seqs", "opt_int"),
                      ("num_kv_blocks", "opt_int"), ("block_size", "int"), ("kernels", "choice"),
                      ("enable_cuda_graphs", "bool"), ("mixed_cuda_graphs", "bool"), ("speculative_method", "choice"), ("num_speculative_tokens", "int"),
                      ("quantization", "choice")]
        cmp_names = [n for n, _ in cmp_fields]
        sides = {}
        with gr.Row():
            for label in ("A", "B"):
                with gr.Column():
                    gr.Markdown(f"**Config {label}**")
                    cs = []
                    vals = config_form_values(host.config, cmp_names)
                    for (name, kind), val in zip(cmp_fields, vals):
                        if label == "B" and name == "scheduling":
                            val = "static" if val == "continuous" else "continuous"   # the classic contrast
                        if kind == "bool":
                            cs.append(gr.Checkbox(value=bool(val), label=name))
                        elif kind == "choice":
                            cs.append(gr.Dropdown(CHOICES[name], value=val, label=name))
                        else:
                            cs.append(gr.Number(value=val, precision=0, label=name))
                    sides[label] = cs
        with gr.Row():
            cmp_preset = gr.Dropdown(list(L.PRESETS), value="One burst", label="workload preset")
            cmp_n = gr.Number(value=16, precision=0, label="number of requests")
            cmp_seed = gr.Number(value=0, precision=0, label="seed")
            cmp_omax = gr.Number(value=64, precision=0, label="output max tokens")
            cmp_run = gr.Button("Run comparison", variant="primary", elem_id="kv-compare-run")
            cmp_stop = gr.Button("Stop", variant="stop")
        cmp_msg = gr.Markdown()
        cmp_table = gr.Dataframe(headers=["Metric", "A", "B", "B / A", "Better"], label="A vs B (same seeded workload)",
                                 interactive=False, elem_id="kv-compare-table")
        with gr.Row():
            cmp_tl_a = gr.Plot(label="A timeline", show_label=False)
            cmp_tl_b = gr.Plot(label="B timeline", show_label=False)

        def compare_fn(*vals):
            try:
                loop = host.require_loop()
                if host.compare is not None and not host.compare.done.is_set():
                    raise ValueError("a comparison is already running")
                if host.load is not None and not host.load.done:
                    raise ValueError("a load is running on the main engine; stop it first for a fair comparison")
                k = len(cmp_names)
                a_vals, b_vals, (pname, n, sd, omax) = vals[:k], vals[k:2 * k], vals[2 * k:]
                base = host.config
                cfgs = {}
                for label, vs in (("A", a_vals), ("B", b_vals)):
                    names_all = config_field_specs()
                    full = dict(zip([x[0] for x in names_all], config_form_values(base, [x[0] for x in names_all])))
                    full.update(dict(zip(cmp_names, vs)))
                    cfgs[label] = config_from_form(list(full), list(full.values()))
                info = L.EngineInfo.from_loop(loop)
                nn = parse_num(n, "number of requests", integer=True, lo=1, hi=2000)
                spec = L.preset(pname, info, num_requests=nn, seed=parse_num(sd, "seed", integer=True, lo=0))
                om = parse_num(omax, "output max tokens", integer=True, lo=1)
                spec.output_len = L.LengthDist(spec.output_len.kind, min(spec.output_len.low, om), om)
                spec.validate(info.max_model_len)
            except (ValueError, EngineUnavailable) as e:
                return f"⚠️ {e}"
            host.compare = CompareJob(cfgs, spec, None, loop_factory=host.loop_factory).start()
            return f"Running **{spec.name}** ({spec.num_requests} requests, seed {spec.seed}) under A, then B…"

        cmp_run.click(compare_fn, [*sides["A"], *sides["B"], cmp_preset, cmp_n, cmp_seed, cmp_omax], cmp_msg,
                      api_name="compare", concurrency_limit=1)
        cmp_stop.click(lambda: (host.compare.stop() if host.compare else None) or "Stopping the comparison.",
                       None, cmp_msg, api_visibility="private", queue=False)
        cmp_shown = gr.State(None)

        def compare_status(shown_id):
            job = host.compare
            if job is None:
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), shown_id
            if not job.done.is_set():
                prog_txt = job.status
                if job.runner is not None:
                    prog_txt += " — " + L.format_progress(job.runner.progress())
                return prog_txt, gr.skip(), gr.skip(), gr.skip(), shown_id
            if shown_id == id(job):
                return gr.skip(), gr.skip(), gr.skip(), gr.skip(), shown_id
            if job.error:
                return f"⚠️ comparison failed: {job.error}", gr.skip(), gr.skip(), gr.skip(), id(job)
            errs = "".join(f"<br>⚠️ config {k}: {v}" for k, v in job.errors.items())
            if not job.results:
                return f"Comparison {job.status}.{errs}", gr.skip(), gr.skip(), gr.skip(), id(job)
            tbl = compare_table(job.results)
            figs = []
            for label in ("A", "B"):
                snap = job.snapshots.get(label)
                if snap is None:
                    figs.append(spec_plot(F.empty_spec(f"{label}", "did not run", 300)))
                else:
                    sp = F.timeline_spec(snap, max_requests=32)
                    sp["layout"]["title"]["text"] = f"Config {label} — " + sp["layout"]["title"]["text"]
                    figs.append(spec_plot(sp))
            return f"Comparison {job.status}.{errs}", tbl, figs[0], figs[1], id(job)

        def compare_report() -> dict:
            """For API clients: the comparison's status and, when done, each config's summary."""
            job = host.compare
            if job is None:
                return {"status": None}
            return {"status": job.status, "done": job.done.is_set(), "error": job.error, "errors": job.errors,
                    "results": job.results if job.done.is_set() else None,
                    "table": compare_table(job.results).to_dict("records") if job.done.is_set() and job.results else None}

        gr.api(compare_report, api_name="compare_report", concurrency_limit=None)

        cmp_timer = gr.Timer(1.0)
        cmp_timer.tick(compare_status, cmp_shown, [cmp_msg, cmp_table, cmp_tl_a, cmp_tl_b, cmp_shown],
                       concurrency_limit=None, show_progress="hidden", api_visibility="private")
    tab.select(None, None, None, js=RESIZE_PLOTS_JS, queue=False, api_visibility="private")


def export_tab(host: EngineHost) -> None:
    with gr.Tab("Export", id="export"):
        gr.Markdown("Download what the inspector recorded: per-request metrics (CSV, one row per finished request, "
                    "latencies in ms), per-step records (CSV), and the timeline as Chrome-trace JSON — open it in "
                    "[Perfetto](https://ui.perfetto.dev) or `chrome://tracing`.")
        with gr.Row():
            b_csv = gr.Button("Metrics CSV", elem_id="kv-export-csv")
            b_steps = gr.Button("Steps CSV")
            b_trace = gr.Button("Chrome trace JSON", elem_id="kv-export-trace")
        exp_files = gr.File(label="Downloads", file_count="multiple", interactive=False, elem_id="kv-export-files")
        outdir = Path(tempfile.mkdtemp(prefix="kvscope-export-"))

        def _export(kind: str):
            snap = host.recorder.snapshot(kv=None)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            if kind == "csv":
                if not snap.records:
                    raise gr.Error("no finished requests recorded yet")
                p = outdir / f"kvscope-metrics-{stamp}.csv"
                X.metrics_csv(snap.records, p)
            elif kind == "steps":
                if not snap.steps:
                    raise gr.Error("no engine steps recorded yet")
                p = outdir / f"kvscope-steps-{stamp}.csv"
                X.steps_frame(snap).to_csv(p, index=False)
            else:
                if not snap.steps and not snap.requests:
                    raise gr.Error("nothing recorded yet")
                p = outdir / f"kvscope-trace-{stamp}.json"
                X.chrome_trace_json(snap, p)
            return [str(p)]

        b_csv.click(lambda: _export("csv"), None, exp_files, api_name="export_csv")
        b_steps.click(lambda: _export("steps"), None, exp_files, api_name="export_steps")
        b_trace.click(lambda: _export("trace"), None, exp_files, api_name="export_trace")
