"""Speculative decoding's counters, kept by the drafter as it learns each verified run's outcome.

Torch-free: the engine's stats snapshot carries them to the server, which exports them
(`spec_decode/metrics.py`).
"""

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

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Count a verified run of `num_drafted` drafts whose first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        if len(per_position) < num_drafted:
            per_position.extend([0] * (num_drafted - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )
