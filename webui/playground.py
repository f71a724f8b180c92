"""Playground tab: chat or raw completion, streamed, with every sampling control; also the gr.api endpoints."""
from __future__ import annotations

import dataclasses
import logging

import gradio as gr

from engine.sampling_params import MAX_LOGPROBS
from engine.entrypoints.openai.tool_parsers import tool_parser_for
from engine.entrypoints.openai.tools import parse_output, render_chat, tool_constraint
from webui.forms import (MAX_PROMPT_CHARS, STRUCTURED_KINDS, TOOL_CHOICES, check_conversation, make_sampling_params,
                         make_tools)
from webui.host import EngineHost, EngineUnavailable, max_model_len
from webui.render import logprobs_rows, request_stats_md, tool_calls_md

log = logging.getLogger("kvscope.app")

# a person's turn is scheduled ahead of simulated users (priority 0) when the engine's scheduling_policy
# is "priority" (lower = sooner, as in vLLM); under "fcfs" it stays 0
PLAYGROUND_PRIORITY = -1

TOOLS_PLACEHOLDER = ('{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": "object", '
                     '"properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}')


def _check_text(field: str, text, empty_msg: str) -> None:
    """A typed prompt or message: not blank, at most MAX_PROMPT_CHARS (the error names the field and limit)."""
    if not text or not str(text).strip():
        raise ValueError(f"{field}: {empty_msg}")
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"{field}: too long ({len(text)} characters; at most {MAX_PROMPT_CHARS})")


def playground_tab(host: EngineHost) -> None:
    with gr.Tab("Playground", id="playground"):
        with gr.Row():
            with gr.Column(scale=3):
                mode = gr.Radio(["Chat", "Completion"], value="Chat", label="Mode",
                                info="Chat applies the model's chat template; Completion sends raw text.")
                with gr.Group(visible=True) as chat_group:
                    chatbot = gr.Chatbot(label="Chat", height=380, elem_id="kv-chatbot")
                    system = gr.Textbox(label="System prompt (optional)", lines=1, placeholder="You are a helpful assistant.")
                    chat_in = gr.Textbox(label="Message", placeholder="Ask something…", lines=2, elem_id="kv-chat-input")
                    with gr.Accordion("Tools (function calling)", open=False):
                        tools_box = gr.Textbox(label="functions (JSON: one function, a list, or OpenAI `tools`)",
                                               lines=4, elem_id="kv-tools", placeholder=TOOLS_PLACEHOLDER)
                        tool_choice = gr.Dropdown(TOOL_CHOICES, value="auto", allow_custom_value=True,
                                                  label="tool choice", elem_id="kv-tool-choice",
                                                  info="auto: the model decides; required, or a function's name: "
                                                       "a JSON-schema grammar makes the reply a valid call")
                with gr.Group(visible=False) as comp_group:
                    comp_in = gr.Textbox(label="Prompt (raw text)", lines=5, elem_id="kv-comp-input",
                                         placeholder="Once upon a time")
                    comp_out = gr.Textbox(label="Completion", lines=8, interactive=False, elem_id="kv-comp-output")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="kv-send")
                    stop = gr.Button("Stop", variant="stop", elem_id="kv-stop")
                    clear = gr.Button("Clear")
                req_stats = gr.Markdown(elem_id="kv-req-stats")
                lp_table = gr.Dataframe(headers=["#", "token", "logprob", "prob", "top alternatives"],
                                        label="Per-token logprobs (enable in Sampling)", visible=True,
                                        interactive=False, max_height=300, wrap=True)
            with gr.Column(scale=2):
                with gr.Accordion("Sampling", open=True):
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="temperature (0 = greedy)",
                                            elem_id="kv-temperature")
                    top_p = gr.Slider(0.01, 1, value=0.95, step=0.01, label="top-p")
                    top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
                    min_p = gr.Slider(0, 1, value=0.0, step=0.01, label="min-p")
                    max_tokens = gr.Number(value=128, precision=0, label="max tokens")
                    min_tokens = gr.Number(value=0, precision=0, label="min tokens")
                    rep_pen = gr.Slider(0.5, 2, value=1.0, step=0.01, label="repetition penalty")
                    pres_pen = gr.Slider(-2, 2, value=0.0, step=0.05, label="presence penalty")
                    freq_pen = gr.Slider(-2, 2, value=0.0, step=0.05, label="frequency penalty")
                    seed = gr.Textbox(value="", label="seed (empty = random)", placeholder="random", max_lines=1,
                                      elem_id="kv-seed")   # a gr.Number would show and send 0
                    stop_str = gr.Textbox(label="stop strings (one per line)", lines=2)
                    ignore_eos = gr.Checkbox(value=False, label="ignore EOS")
                    with gr.Row():
                        lp_on = gr.Checkbox(value=False, label="logprobs")
                        lp_n = gr.Slider(0, MAX_LOGPROBS, value=3, step=1, label="top-n alternatives")
                    so_kind = gr.Dropdown(STRUCTURED_KINDS, value="none", label="structured output",
                                          elem_id="kv-so-kind",
                                          info="constrain the reply: every token is masked to what the constraint "
                                               "still allows")
                    so_text = gr.Textbox(label="constraint (JSON schema, regex, one choice per line, or Lark grammar)",
                                         lines=4, elem_id="kv-so-text",
                                         placeholder='{"type": "object", "properties": {"answer": {"type": "string"}}}')
        sampling = [temperature, top_p, top_k, min_p, max_tokens, min_tokens, rep_pen, pres_pen, freq_pen,
                    seed, stop_str, ignore_eos, lp_on, lp_n, so_kind, so_text]

        def _session(request: gr.Request | None) -> str:
            return getattr(request, "session_hash", None) or "api"

        def _run_stream(prompt, params, session: str, rid: str):
            loop = host.require_loop()
            if loop.engine.config.scheduler_config.scheduling_policy == "priority":
                params = dataclasses.replace(params, priority=PLAYGROUND_PRIORITY)
            stream = loop.submit(prompt, params, request_id=rid)
            host._active[session] = stream
            out = None
            try:
                for out in stream:
                    yield out
            finally:
                host._active.pop(session, None)
                if out is None or not out.finished:
                    try:
                        stream.cancel()
                    except Exception:
                        pass
                elif out is not None:
                    host.recorder.record_output(out)

        def _text(content) -> str:
            if isinstance(content, str):
                return content
            if isinstance(content, dict):
                return str(content.get("text") or content.get("content") or "")
            if isinstance(content, (list, tuple)):
                return "".join(_text(c) for c in content)
            return str(content or "")

        def chat_fn(message, history, system_prompt, tools_text, tool_choice_text, *samp,
                    request: gr.Request = None):
            """Yields (history, message box, request stats, logprobs rows, tool calls [{name, arguments}])."""
            history = list(history or [])
            try:
                _check_text("message", message, "please type a message first")
                params = make_sampling_params(*samp, max_model_len=max_model_len(host))
                tools, choice = make_tools(tools_text, tool_choice_text)
                loop = host.require_loop()
                system_prompt = str(system_prompt or "")
                msgs = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
                msgs += [{"role": m["role"], "content": _text(m["content"])} for m in history
                         if m.get("role") in ("user", "assistant")]
                msgs.append({"role": "user", "content": message})
                check_conversation(msgs)
                parser = tool_parser_for(None, getattr(loop.engine.tokenizer, "chat_template", None))
                constraint = tool_constraint(choice, tools or [], None)
                if constraint is not None:
                    if params.structured_outputs is not None:
                        raise ValueError("tool choice: 'required' or a named function is itself a structured-output "
                                         "constraint; set structured output to none")
                    params = dataclasses.replace(params, structured_outputs=constraint)
                prompt = render_chat(loop.engine, msgs, tools, choice, parser)
            except (ValueError, EngineUnavailable) as e:
                raise gr.Error(str(e), duration=8)
            rid = host.next_id("chat")
            history = history + [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
            yield history, "", "", [], []
            try:
                for out in _run_stream(prompt, params, _session(request), rid):
                    calls, text = [], out.text
                    if out.finished and tools and choice.mode != "none":
                        content, parsed = parse_output(out.text, choice, parser, None)
                        calls = [{"name": c.name, "arguments": c.arguments} for c in parsed]
                        text = tool_calls_md(content, calls, constraint)
                    history[-1] = {"role": "assistant", "content": text}
                    yield (history, "", request_stats_md(out, rid), logprobs_rows(out) if out.finished else gr.skip(),
                           calls)
            except ValueError as e:
                raise gr.Error(str(e), duration=8)
            except Exception as e:  # an error in one request never takes the app down
                log.exception("chat request failed")
                raise gr.Error(f"request failed: {type(e).__name__}: {e}", duration=8)

        def complete_fn(prompt, *samp, request: gr.Request = None):
            try:
                _check_text("prompt", prompt, "please enter a prompt first")
                params = make_sampling_params(*samp, max_model_len=max_model_len(host))
            except (ValueError, EngineUnavailable) as e:
                raise gr.Error(str(e), duration=8)
            rid = host.next_id("completion")
            yield "", "", []
            try:
                for out in _run_stream(prompt, params, _session(request), rid):
                    yield out.text, request_stats_md(out, rid), logprobs_rows(out) if out.finished else gr.skip()
            except (ValueError, EngineUnavailable) as e:
                raise gr.Error(str(e), duration=8)
            except Exception as e:
                log.exception("completion request failed")
                raise gr.Error(f"request failed: {type(e).__name__}: {e}", duration=8)

        def stop_fn(request: gr.Request = None):
            s = host._active.get(_session(request))
            if s is None:
                return gr.skip()
            s.cancel()
            return gr.skip()

        def send_fn(m, message, history, system_prompt, tools_text, tool_choice_text, comp_prompt, *samp,
                    request: gr.Request = None):
            """The Send button serves whichever mode is shown."""
            if m == "Completion":
                for text, stats, lps in complete_fn(comp_prompt, *samp, request=request):
                    yield gr.skip(), gr.skip(), text, stats, lps
            else:
                for hist, box, stats, lps, _ in chat_fn(message, history, system_prompt, tools_text, tool_choice_text,
                                                        *samp, request=request):
                    yield hist, box, gr.skip(), stats, lps

        mode.change(lambda m: (gr.update(visible=m == "Chat"), gr.update(visible=m == "Completion")),
                    mode, [chat_group, comp_group], api_visibility="private", queue=False)
        send_outs = [chatbot, chat_in, comp_out, req_stats, lp_table]
        send_ins = [mode, chat_in, chatbot, system, tools_box, tool_choice, comp_in, *sampling]
        send.click(send_fn, send_ins, send_outs, concurrency_limit=None, api_visibility="private",
                   show_progress="minimal")
        chat_in.submit(send_fn, send_ins, send_outs, concurrency_limit=None, api_visibility="private",
                       show_progress="minimal")
        stop.click(stop_fn, None, None, concurrency_limit=None, api_name="stop", queue=False)
        clear.click(lambda: ([], "", "", [], ""), None, [chatbot, chat_in, req_stats, lp_table, comp_out],
                    api_visibility="private", queue=False)

        # API endpoints (gradio_client): streaming completion and chat with every sampling control
        def complete(prompt: str, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                     min_p: float = 0.0, max_tokens: int = 64, min_tokens: int = 0,
                     repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, seed: int | None = None, stop: str = "",
                     ignore_eos: bool = False, logprobs: int | None = None,
                     request: gr.Request = None) -> dict:
            """Stream a raw-text completion: yields {text, finished, finish_reason, request_id, stats}."""
            for text, stats, lps in complete_fn(prompt, temperature, top_p, top_k, min_p, max_tokens, min_tokens,
                                                repetition_penalty, presence_penalty, frequency_penalty, seed,
                                                stop, ignore_eos, logprobs is not None, logprobs or 0,
                                                request=request):
                yield {"text": text, "stats": stats, "logprobs": lps if isinstance(lps, list) else None}

        gr.api(complete, api_name="complete", concurrency_limit=None)

        def chat(message: str, system_prompt: str = "", temperature: float = 0.0, max_tokens: int = 64,
                 seed: int | None = None, tools: str = "", tool_choice: str = "auto",
                 request: gr.Request = None) -> dict:
            """Stream a one-turn chat reply through the model's chat template; `tools` as the Playground's tools
            box (JSON), `tool_choice` auto / required / none / a function's name. The last update carries the
            parsed `tool_calls` ([{name, arguments}])."""
            for hist, _, stats, _, calls in chat_fn(message, [], system_prompt, tools, tool_choice, temperature, 1.0,
                                                    0, 0.0, max_tokens, 0, 1.0, 0.0, 0.0, seed, "", False, False, 0,
                                                    request=request):
                yield {"text": _text(hist[-1]["content"]) if hist else "", "stats": stats, "tool_calls": calls}

        gr.api(chat, api_name="chat", concurrency_limit=None)
