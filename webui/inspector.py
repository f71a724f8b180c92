"""Inspector tab: timers read the producer's latest snapshot and send only the charts that changed."""
from __future__ import annotations

import logging
import time

import gradio as gr

from inspector import figures as F
from inspector.profile import can_profile, profile_one_step
from inspector.recorder import kv_replicas
from webui.host import EngineHost, EngineUnavailable
from webui.render import RESIZE_PLOTS_JS, plot, spec_plot

log = logging.getLogger("kvscope.app")


def inspector_tab(host: EngineHost) -> None:
    with gr.Tab("Inspector", id="inspector") as tab:
        with gr.Row():
            live = gr.Checkbox(value=True, label="live (refresh ~1 s)", scale=1)
            axis = gr.Radio(["time", "step"], value="time", label="timeline axis", scale=1)
            req_dd = gr.Dropdown([], value=None, label="request (block table + highlight)", allow_custom_value=True,
                                 scale=2, elem_id="kv-req-dd")
            insp_info = gr.Markdown(elem_id="kv-insp-info")
        with gr.Row():
            with gr.Column(scale=3):
                p_block = gr.Plot(label="KV block map", show_label=False, elem_id="kv-plot-blockmap")
            with gr.Column(scale=2):
                p_table = gr.Plot(label="Block table", show_label=False, elem_id="kv-plot-blocktable")
        p_timeline = gr.Plot(label="Scheduler timeline", show_label=False, elem_id="kv-plot-timeline")
        p_tp = gr.Plot(label="Throughput", show_label=False, elem_id="kv-plot-throughput")
        p_mem = gr.Plot(label="Memory", show_label=False, elem_id="kv-plot-memory")
        p_lat = gr.Plot(label="Latency", show_label=False, elem_id="kv-plot-latency")
        p_timings = gr.Plot(label="Step timings", show_label=False, elem_id="kv-plot-timings")
        p_weights = gr.Plot(label="Model weights", show_label=False, elem_id="kv-plot-weights")
        p_parallel = gr.Plot(label="Tensor parallelism", show_label=False, elem_id="kv-plot-parallel")
        with gr.Row():
            prof_btn = gr.Button("Profile one step (torch.profiler)", elem_id="kv-profile")
            prof_msg = gr.Markdown()
        p_prof = gr.Plot(label="Profile", show_label=False, visible=False, elem_id="kv-plot-profile")
        p_spec = gr.Plot(label="Speculative decoding", show_label=False, elem_id="kv-plot-spec")
        sent = gr.State({})
        outs = [p_block, p_table, p_timeline, p_tp, p_mem, p_lat, p_timings, p_spec, p_weights, p_parallel, req_dd, insp_info,
                sent]

        def inspector_fn(selected, ax, is_live, sent_state, force=False):
            """Timer handler: read the producer's latest snapshot; send only what changed."""
            pub = host.published
            sent_state = dict(sent_state or {})
            if (not is_live and not force) or pub.snapshot is None:
                return (*[gr.skip()] * (len(outs) - 1), sent_state)
            res = []

            def send(key, sig, make):
                if not force and sent_state.get(key) == sig:
                    return gr.skip()
                try:
                    v = make()
                except Exception as e:  # one broken chart never takes the others down
                    log.exception("inspector chart %s failed", key)
                    v = spec_plot(F.error_spec(key, e))
                sent_state[key] = sig
                return v

            if selected:
                res.append(send("block_map", (pub.version, selected),
                                lambda: spec_plot(F.block_map_spec(pub.kv, highlight=selected))))
            else:
                res.append(send("block_map", pub.hashes.get("block_map"), lambda: plot(pub.plots["block_map"])))
            res.append(send("block_table", (pub.version, selected),
                            lambda: spec_plot(F.block_table_spec(pub.kv, selected))))
            tl = "timeline_step" if ax == "step" else "timeline"
            if ax == "step":
                host.want_step_axis_until = time.monotonic() + 10.0
                if tl not in pub.plots:            # first request for it: build it here once
                    res.append(send("timeline", ("step-adhoc", pub.version),
                                    lambda: spec_plot(F.timeline_spec(pub.snapshot, axis="step"))))
                    host._kick.set()
                else:
                    res.append(send("timeline", (tl, pub.hashes.get(tl)), lambda: plot(pub.plots[tl])))
            else:
                res.append(send("timeline", (tl, pub.hashes.get(tl)), lambda: plot(pub.plots[tl])))
            for name in ("throughput", "memory", "latency", "timings", "spec", "weights", "parallel"):
                res.append(send(name, pub.hashes.get(name), lambda n=name: plot(pub.plots[n])))
            snap = pub.snapshot
            holding = sorted(rid for kv in kv_replicas(pub.kv) for rid in kv.get("block_tables", {}))
            recent = [r.request_id for r in snap.requests[-30:]][::-1]
            choices = list(dict.fromkeys(holding + recent))
            ck = hash(tuple(choices))
            if sent_state.get("choices") != ck or force:
                sent_state["choices"] = ck
                res.append(gr.update(choices=choices))
            else:
                res.append(gr.skip())
            t = snap.totals
            info = (f"<sub>snapshot #{pub.version} · built in {pub.build_ms:.0f} ms · {t.get('steps', 0)} steps, "
                    f"{len(snap.requests)} requests recorded"
                    + (f" · {snap.dropped_events} events dropped (ring buffer)" if snap.dropped_events else "")
                    + "</sub>")
            res.append(send("info", info, lambda: info))
            return (*res, sent_state)

        insp_timer = gr.Timer(1.0)
        insp_timer.tick(inspector_fn, [req_dd, axis, live, sent], outs, concurrency_limit=None,
                        show_progress="hidden", api_visibility="private")
        req_dd.change(lambda s, a, lv, st: inspector_fn(s, a, lv, st, force=True), [req_dd, axis, live, sent], outs,
                      concurrency_limit=None, show_progress="hidden", api_visibility="private")
        axis.change(lambda s, a, lv, st: inspector_fn(s, a, lv, st, force=True), [req_dd, axis, live, sent], outs,
                    concurrency_limit=None, show_progress="hidden", api_visibility="private")

        def inspector(selected: str = "", axis: str = "time") -> dict:
            """For API clients and tests: a fresh snapshot; every chart as Plotly JSON plus the kv snapshot."""
            pub = host.publish()
            plots = dict(pub.plots)
            if selected:
                plots["block_map"] = F.to_json(F.block_map_spec(pub.kv, highlight=selected))
            plots["block_table"] = F.to_json(F.block_table_spec(pub.kv, selected or None))
            snap = pub.snapshot
            return {"plots": plots, "kv": pub.kv, "stats": pub.stats, "totals": snap.totals,
                    "requests": [dict(request_id=r.request_id, status=r.status, prompt_len=r.prompt_len,
                                      output_len=r.output_len, num_preemptions=r.num_preemptions,
                                      priority=r.priority, structured=r.structured, engine_index=r.engine_index,
                                      phases=sorted({sp.phase for sp in r.spans})) for r in snap.requests]}

        gr.api(inspector, api_name="inspector", concurrency_limit=None)

        def profile_fn():
            try:
                loop = host.require_loop()
            except EngineUnavailable as e:
                return str(e), gr.update(visible=False)
            if not can_profile(loop):
                return "This engine has no `profile_step()`: per-kernel profiling is unavailable.", gr.update(visible=False)
            st = loop.stats()
            if not (st.get("num_running") or st.get("num_waiting")):
                return ("The profiler records the next engine step: start a load or send a prompt first, then "
                        "press again while requests run."), gr.update(visible=False)
            try:
                rows = profile_one_step(loop, timeout=15.0)
            except Exception as e:
                log.exception("profile failed")
                return f"Profiling failed: {type(e).__name__}: {e}", gr.update(visible=False)
            if not rows:
                return "No step ran while profiling (the engine went idle).", gr.update(visible=False)
            host.profile_rows = rows
            return (f"Profiled one step: {len(rows)} ops/kernels (self time; Triton kernels in red).",
                    gr.update(value=spec_plot(F.profile_spec(rows)), visible=True))

        prof_btn.click(profile_fn, None, [prof_msg, p_prof], api_name="profile_step", concurrency_limit=1)
    tab.select(None, None, None, js=RESIZE_PLOTS_JS, queue=False, api_visibility="private")
