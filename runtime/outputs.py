"""Hand-off types between the engine's layers: what the model runner and the sampler return.

Plain data (no torch), so the text side (output processing) reads a step's result without
importing the torch side that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler picked for each row of the step."""

    token_ids: list[int]
    # Raw log-probability of each sampled token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row the top-k (token id, logprob) alternatives, k = that row's `logprobs` ([] for None/0).
    top_logprobs: list[list[tuple[int, float]]] | None
    # Speculative verification only: per row, whether the draft placed there was accepted.
    accepted: list[bool] | None = None
    # The sampled tokens as a tensor where they were made (a torch.Tensor; typed loosely since
    # this module imports no torch): async scheduling feeds them to the next step from there.
    token_tensor: Any = None


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What one step produced for each request that got tokens.

    Without speculation a request gets one token per step; with it, the accepted draft tokens
    plus one token sampled from the target (a bonus token, or the correction of the first
    rejected draft), so `token_ids[i]` holds 1..K+1 tokens in order.
    """

    request_ids: list[str]
    token_ids: list[list[int]]
    # Aligned with `token_ids`; None when no request of the step asked for logprobs (rows of
    # requests that did not ask hold an empty list).
    logprobs: list[list[TokenLogprob]] | None
    num_tokens: int  # tokens the model ran over (the batch size in tokens)
    duration_s: float
    # Per request, how many draft tokens the step verified (all zero without speculation).
    num_draft_tokens: list[int] | None = None


@dataclass(frozen=True)
class WeightsReport:
    """What the model runner loaded, for the startup log and /metrics: format, kernels and size."""

    # The checkpoint's quantization method ("gguf", "fp8", "awq", "gptq"), None for a float model.
    quantization: str | None
    # What runs each layer (`gguf Q4_1 (...)`, `dense float32`) -> how many layers run it.
    kernels: dict[str, int]
    # Bytes the weights take where they live (packed data, scales, dense parameters).
    weight_bytes: int

    def summary(self) -> str:
        """One line: `gguf, 85.1 MiB: 210 x gguf Q4_1 (...), 61 x dense float32`."""
        parts = ", ".join(f"{count} x {kernel}" for kernel, count in sorted(self.kernels.items()))
        return f"{self.quantization or 'unquantized'}, {self.weight_bytes / 2**20:.1f} MiB: {parts}"
