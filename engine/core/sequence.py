"""Sequence: one request's state as it moves through the scheduler (tokens, computed tokens, blocks, timings)."""
from __future__ import annotations

import enum
from collections import deque

from engine.outputs import Logprob, RequestMetrics
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)      # prompt + output, the sequence's whole history
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0                 # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.host_block_table: list[int] = []        # swapped out: its blocks in the host tier (block_table empty)
        self.block_hashes: list[int] = []            # chained hashes of full blocks of token_ids
        self.num_committed_blocks = 0                # leading blocks whose hash is published
        self.num_cached_tokens = 0
        self.spec_token_ids: list[int] = []          # draft tokens to verify next step
        self.matcher = None                          # llguidance matcher of a constrained request: has
        #                                              consumed exactly the output tokens (recompute keeps them)
        self.grammar_ahead: deque = deque()          # (reason, stop_reason) of tokens a grammar block fed to the
        #                                              matcher before post-processing reached them
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.logprobs: list[list[Logprob]] | None = [] if params.logprobs is not None else None
        # per prompt position (the first: None): [the prompt token's Logprob, top-n...], filled by the prefill
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None] * len(self.token_ids)
        self.admitted = False                        # ever scheduled (prefix-cache stats counted once)
        # detokenizer state
        self.text = ""
        self.sent_text_len = 0                       # chars of `text` already streamed
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_sent_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
