"""LLM: the offline, user-facing API (generate / chat / stream), vLLM style."""
from __future__ import annotations

from typing import Iterator, Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.runtime.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, device: str = "auto", **config):
        cfg = EngineConfig(model=model, device=device, **config)
        self.client = None          # data_parallel_size > 1: the replicas' client; self.engine validates
        if cfg.parallel_config.data_parallel_size > 1:
            from engine.runtime.dp_client import DPEngineClient
            self.client = DPEngineClient(cfg)
            self.engine = self.client.engine
        else:
            self.engine = LLMEngine(cfg)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine (its worker and replica processes) now."""
        if self.client is not None:
            self.client.shutdown()
        else:
            self.engine.close()

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def _params_list(self, n: int, params) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts")
        return params

    @staticmethod
    def _prompt_list(prompts) -> list:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = self._prompt_list(prompts)
        plist = self._params_list(len(prompts), sampling_params)
        if self.client is not None:             # data parallel: the replicas run them; wait in order
            streams = self.client.submit_many([(p, sp, None) for p, sp in zip(prompts, plist)])
            return [s.result() for s in tqdm(streams, desc="generate", disable=not use_tqdm)]
        # validate all before adding any, so a bad prompt leaves the engine untouched
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, plist)]
        order = {s.request_id: i for i, s in enumerate(seqs)}
        for s in seqs:
            self.engine.add_sequence(s)
        results: list[RequestOutput | None] = [None] * len(seqs)
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        self.engine.output_processor.final_outputs_only = True
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        bar.update(1)
        finally:
            self.engine.output_processor.final_outputs_only = False
            bar.close()
            for s in seqs:                      # interrupted: leave nothing behind
                if not s.is_finished:
                    self.engine.abort_request(s.request_id)
        return results  # type: ignore[return-value]

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.engine.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield this request's outputs step by step (other requests already queued keep running)."""
        if self.client is not None:
            yield from self.client.submit(prompt, sampling_params)
            return
        rid = self.engine.add_request(prompt, sampling_params)
        done = False
        try:
            while not done and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            if not done:
                self.engine.abort_request(rid)
