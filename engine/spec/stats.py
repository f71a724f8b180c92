"""Speculative decoding's counters and the acceptance arithmetic the drafters decide by (vLLM's metrics:
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted / drafts)."""
from __future__ import annotations

PROBE_FIRST = 16             # auto-off: output tokens before a request whose drafting is off is probed


class SpecStats:
    def __init__(self, k: int):
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def add(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def to_dict(self) -> dict:
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens, accepted_per_pos=list(self.accepted_per_pos),
                    acceptance_rate=acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens),
                    mean_acceptance_length=mean_acceptance_length(self.num_accepted_tokens, self.num_drafts))


def acceptance_rate(accepted: int, draft_tokens: int) -> float | None:
    return accepted / draft_tokens if draft_tokens else None


def mean_acceptance_length(accepted: int, drafts: int) -> float | None:
    return 1.0 + accepted / drafts if drafts else None


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of k drafts yields when each draft is accepted with probability a: 1 + a + ... + a^k."""
    return float(sum(a ** j for j in range(k + 1)))
