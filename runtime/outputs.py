"""Hand-off types between the engine's layers: what the model runner and the sampler return.

Plain data (no torch), so the text side (output processing) reads a step's result without
importing the torch side that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler picked for each row of the step."""

    token_ids: list[int]
    # Raw log-probability of each sampled token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row the top-k (token id, logprob) alternatives, k = that row's `logprobs` ([] for None/0).
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass(frozen=True)
class StepResult:
    """What one forward pass produced: a token for each request that finished its prompt."""

    request_ids: list[str]
    sampled: SamplerOutput
    num_tokens: int
    duration_s: float
