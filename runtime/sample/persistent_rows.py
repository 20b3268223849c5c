"""Sampling parameters kept across steps in row-indexed tensors (vLLM's persistent input batch).

`SamplingBatch.build` packs every request's parameters into fresh tensors each step: about 0.9 ms
of Python at batch 256 (docs/benchmarks.md). Most of that is the same every step. Here a request
gets a row when it first samples and keeps it until it finishes; its parameters are written once.
The float parameters share one `[rows, 6]` tensor and the integer ones one `[rows, 3]` tensor, so a
step's batch is two gathers by the step's row indices and two copies to the device, plus the parts
that do change every step (the output position each row samples at, and min_tokens suppression).

Rows come from `RequestRows`, which keys them by the `Request` object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvasir.runtime.core.scheduler_output import RequestView
from kvasir.runtime.sample.metadata import (
    GREEDY_TEMPERATURE_EPS,
    PendingRow,
    SamplingBatch,
    SamplingRow,
    _suppressed,
    _wrap_int64,
)
from kvasir.runtime.sample.request_rows import RequestRows

_FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_COLUMNS = ("top_k", "seeds", "min_tokens")
_FLOAT_INDEX = {name: i for i, name in enumerate(_FLOAT_COLUMNS)}
_INT_INDEX = {name: i for i, name in enumerate(_INT_COLUMNS)}


class PersistentSamplingRows:
    """Row-indexed parameter tensors on the CPU; `build` gathers a step's rows onto the device."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._floats = torch.zeros(0, len(_FLOAT_COLUMNS), dtype=torch.float32)
        self._ints = torch.zeros(0, len(_INT_COLUMNS), dtype=torch.int64)
        self._logprobs: list[int | None] = []
        self._rows = RequestRows(self._grow, capacity)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished."""
        self._rows.release(request_ids)

    def build(self, requests: Sequence[RequestView], pending: Sequence[bool] | None = None) -> SamplingBatch:
        """The step's batch for `requests` in row order; `pending[i]`: request i samples one token
        beyond what the host has seen (async scheduling)."""
        pending = pending or [False] * len(requests)

        def rows() -> list[SamplingRow]:
            return [PendingRow(r) if ahead else r for r, ahead in zip(requests, pending, strict=True)]

        indices = [self._row(request) for request in requests]
        index = torch.tensor(indices, dtype=torch.int64)
        floats, ints = self._floats[index], self._ints[index]
        f, i = _FLOAT_INDEX, _INT_INDEX
        penalized = (
            (floats[:, f["repetition_penalty"]] != 1.0)
            | (floats[:, f["presence_penalty"]] != 0.0)
            | (floats[:, f["frequency_penalty"]] != 0.0)
        )
        if bool(penalized.any()):
            # Penalties need each row's token history, which changes every step: built afresh.
            return SamplingBatch.build(rows(), self.vocab_size, self.device)
        positions = torch.from_numpy(
            np.fromiter(
                (request.num_output_tokens + ahead for request, ahead in zip(requests, pending, strict=True)),
                dtype=np.int64,
                count=len(requests),
            )
        )
        temperature, top_p, min_p, top_k = (
            floats[:, f["temperature"]],
            floats[:, f["top_p"]],
            floats[:, f["min_p"]],
            ints[:, i["top_k"]],
        )
        greedy = temperature == 0.0
        random_rows = ~greedy
        suppressed = None
        if bool((ints[:, i["min_tokens"]] > positions).any()):
            suppressed = _suppressed(rows(), self.vocab_size, self.device)
        # One copy per dtype; the columns handed to the sampler are views of those copies.
        floats_on, ints_on = floats.to(self.device), ints.to(self.device)
        return SamplingBatch(
            temperature=floats_on[:, f["temperature"]],
            top_p=floats_on[:, f["top_p"]],
            top_k=ints_on[:, i["top_k"]],
            min_p=floats_on[:, f["min_p"]],
            presence_penalty=floats_on[:, f["presence_penalty"]],
            frequency_penalty=floats_on[:, f["frequency_penalty"]],
            repetition_penalty=floats_on[:, f["repetition_penalty"]],
            seeds=ints_on[:, i["seeds"]],
            output_positions=positions.to(self.device),
            prompt_token_ids=None,
            output_token_ids=None,
            suppressed_token_ids=suppressed,
            num_logprobs=tuple(self._logprobs[row] for row in indices),
            vocab_size=self.vocab_size,
            all_greedy=bool(greedy.all()),
            all_random=bool(random_rows.all()),
            needs_top_k=bool(((top_k < self.vocab_size) & random_rows).any()),
            needs_top_p=bool(((top_p < 1.0) & random_rows).any()),
            needs_min_p=bool(((min_p > 0.0) & random_rows).any()),
            needs_penalties=False,
        )

    # ---- rows ---------------------------------------------------------------------------------

    def _row(self, request: RequestView) -> int:
        row, is_new = self._rows.row(request)
        if is_new:
            self._write(row, request)
        return row

    def _write(self, row: int, request: RequestView) -> None:
        params = request.sampling_params
        floats: dict[str, float] = {
            "temperature": 0.0 if params.temperature < GREEDY_TEMPERATURE_EPS else params.temperature,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "repetition_penalty": params.repetition_penalty,
        }
        ints: dict[str, int] = {
            "top_k": min(params.effective_top_k, self.vocab_size) or self.vocab_size,
            "seeds": _wrap_int64(request.seed),
            "min_tokens": params.min_tokens,
        }
        self._floats[row] = torch.tensor([floats[name] for name in _FLOAT_COLUMNS], dtype=torch.float32)
        self._ints[row] = torch.tensor([ints[name] for name in _INT_COLUMNS], dtype=torch.int64)
        self._logprobs[row] = params.logprobs

    def _grow(self, capacity: int) -> None:
        old = len(self._logprobs)
        floats = torch.zeros(capacity, len(_FLOAT_COLUMNS), dtype=torch.float32)
        ints = torch.zeros(capacity, len(_INT_COLUMNS), dtype=torch.int64)
        floats[:old], ints[:old] = self._floats, self._ints
        self._floats, self._ints = floats, ints
        self._logprobs.extend([None] * (capacity - old))
