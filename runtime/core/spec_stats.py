"""Speculative decoding's counters, kept by the scheduler as it applies verified drafts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counts since start-up; exported as Prometheus counters (vLLM's spec_decode_*)."""

    num_drafts: int = 0  # verified runs of drafts (one per request and step that speculated)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: runs whose draft at position i (0-based) was accepted.
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )
