"""The per-step sampling inputs: every scheduled request's parameters packed into [R] / [R, L] tensors.

The model runner builds one `SamplingBatch` per step from the requests that need a token; the
sampler then works on whole-batch tensors and never looks at a `Request` again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvasir.runtime.core.scheduler_output import RequestView
from kvasir.runtime.sample.params import SamplingParams, SamplingRow


class PendingRow:
    """A request's sampling row for a step planned before its previous token is known: one more
    output token than the host has seen (it fixes the seed's position and min_tokens)."""

    __slots__ = ("request",)

    def __init__(self, request: RequestView) -> None:
        self.request = request

    @property
    def sampling_params(self) -> SamplingParams:
        return self.request.sampling_params

    @property
    def seed(self) -> int:
        return self.request.seed

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        # Only penalties read the history, and requests with penalties are never planned ahead.
        return self.request.output_token_ids

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.request.eos_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + 1


# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf (as vLLM).
GREEDY_TEMPERATURE_EPS = 1e-5

_INT64_SPAN = 1 << 64
_INT64_MIN = -(1 << 63)


# eq=False: comparing tensors field by field is ambiguous; a batch is compared by identity.
@dataclass(frozen=True, eq=False)
class SamplingBatch:
    """Row r holds the sampling state of the r-th request of the step; all tensors on one device."""

    temperature: torch.Tensor  # [R] float32; greedy rows hold 0
    top_p: torch.Tensor  # [R] float32, 1.0 = off
    top_k: torch.Tensor  # [R] int64 in [1, V]; V = off
    min_p: torch.Tensor  # [R] float32, 0.0 = off
    presence_penalty: torch.Tensor  # [R] float32
    frequency_penalty: torch.Tensor  # [R] float32
    repetition_penalty: torch.Tensor  # [R] float32
    seeds: torch.Tensor  # [R] int64 (the request's seed, wrapped into the int64 range)
    output_positions: torch.Tensor  # [R] int64: index of the token being sampled
    # Token ids padded with vocab_size (a scatter target column that is dropped afterwards);
    # None when no row uses the penalty that needs them.
    prompt_token_ids: torch.Tensor | None  # [R, Lp] int64, for repetition_penalty
    output_token_ids: torch.Tensor | None  # [R, Lo] int64, for all three penalties
    # Ids to mask to -inf while a row has generated fewer than min_tokens; None when no row needs it.
    suppressed_token_ids: torch.Tensor | None  # [R, S] int64, padded with vocab_size
    num_logprobs: tuple[int | None, ...]  # per row: None = no logprobs, k = sampled + top k
    vocab_size: int
    all_greedy: bool
    all_random: bool
    needs_top_k: bool
    needs_top_p: bool
    needs_min_p: bool
    needs_penalties: bool
    # Structured output: [R, ceil(V / 32)] int32, bit t of row r allows token t (rows without a
    # grammar are all ones), or the same unpacked as an additive [R, V] float mask of 0 / -inf
    # (on a CPU); None when no row of the step has a grammar.
    token_bitmask: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    @property
    def max_num_logprobs(self) -> int | None:
        """The largest k asked for in this step, None when no row wants logprobs."""
        asked = [k for k in self.num_logprobs if k is not None]
        return max(asked) if asked else None

    @property
    def greedy_mask(self) -> torch.Tensor:
        """[R] bool: rows that take the argmax."""
        return self.temperature == 0.0

    @classmethod
    def build(cls, requests: Sequence[SamplingRow], vocab_size: int, device: torch.device) -> SamplingBatch:
        """Pack the requests' parameters and token history; row order follows `requests`."""
        params = [request.sampling_params for request in requests]
        temperature = [0.0 if p.temperature < GREEDY_TEMPERATURE_EPS else p.temperature for p in params]
        top_k = [min(p.effective_top_k, vocab_size) or vocab_size for p in params]
        repetition = [p.repetition_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        # Truncation only matters for rows that sample; greedy rows are left untouched.
        random_rows = [i for i, t in enumerate(temperature) if t > 0.0]
        needs_repetition = any(r != 1.0 for r in repetition)
        needs_penalties = needs_repetition or any(presence) or any(frequency)

        def floats(values: Sequence[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            temperature=floats(temperature),
            top_p=floats([p.top_p for p in params]),
            top_k=ints(top_k),
            min_p=floats([p.min_p for p in params]),
            presence_penalty=floats(presence),
            frequency_penalty=floats(frequency),
            repetition_penalty=floats(repetition),
            seeds=ints([_wrap_int64(request.seed) for request in requests]),
            output_positions=ints([request.num_output_tokens for request in requests]),
            prompt_token_ids=(
                _pad([r.prompt_token_ids for r in requests], vocab_size, device) if needs_repetition else None
            ),
            output_token_ids=(
                _pad([r.output_token_ids for r in requests], vocab_size, device) if needs_penalties else None
            ),
            suppressed_token_ids=_suppressed(requests, vocab_size, device),
            num_logprobs=tuple(p.logprobs for p in params),
            vocab_size=vocab_size,
            all_greedy=not random_rows,
            all_random=len(random_rows) == len(params),
            needs_top_k=any(top_k[i] < vocab_size for i in random_rows),
            needs_top_p=any(params[i].top_p < 1.0 for i in random_rows),
            needs_min_p=any(params[i].min_p > 0.0 for i in random_rows),
            needs_penalties=needs_penalties,
        )


def _wrap_int64(seed: int) -> int:
    """Map any Python int onto int64 two's complement, so unsigned 64-bit seeds stay distinct."""
    return (seed - _INT64_MIN) % _INT64_SPAN + _INT64_MIN


def _pad(rows: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[R, max(len, 1)] int64 tensor of the rows, right-padded with pad_id."""
    width = max((len(row) for row in rows), default=0) or 1
    padded = [list(row) + [pad_id] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device)


def _suppressed(
    requests: Sequence[SamplingRow], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Per row the stop ids a request may not sample yet (min_tokens), or None when no row has any."""
    rows: list[list[int]] = []
    for request in requests:
        params = request.sampling_params
        ids: set[int] = set()
        if request.num_output_tokens < params.min_tokens:
            ids.update(params.stop_token_ids)
            # With ignore_eos, EOS does not end the request, so there is nothing to hold off.
            if not params.ignore_eos:
                ids.update(request.eos_token_ids)
        rows.append(sorted(i for i in ids if 0 <= i < vocab_size))
    if not any(rows):
        return None
    return _pad(rows, vocab_size, device)
