"""Sampling parameters kept across steps in row-indexed tensors (vLLM's persistent input batch).

`SamplingBatch.build` packs every request's parameters into fresh tensors each step: about 0.9 ms
of Python at batch 256 (docs/benchmarks.md). Most of that is the same every step. Here a request
gets a row when it first samples and keeps it until it finishes; its parameters are written once.
A step's batch is then one gather per column by the step's row indices, plus the parts that do
change every step (the output position each row samples at, and min_tokens suppression).

Rows come from `RequestRows`, which keys them by the `Request` object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvasir.runtime.core.request import Request
from kvasir.runtime.core.request_rows import RequestRows
from kvasir.runtime.sample.metadata import (
    GREEDY_TEMPERATURE_EPS,
    PendingRow,
    SamplingBatch,
    SamplingRow,
    _suppressed,
    _wrap_int64,
)

_FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_COLUMNS = ("top_k", "seeds", "min_tokens")


class PersistentSamplingRows:
    """Row-indexed parameter tensors on the CPU; `build` gathers a step's rows onto the device."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._columns: dict[str, torch.Tensor] = {}
        self._logprobs: list[int | None] = []
        self._rows = RequestRows(self._grow, capacity)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished."""
        self._rows.release(request_ids)

    def build(self, requests: Sequence[Request], pending: Sequence[bool] | None = None) -> SamplingBatch:
        """The step's batch for `requests` in row order; `pending[i]`: request i samples one token
        beyond what the host has seen (async scheduling)."""
        pending = pending or [False] * len(requests)

        def rows() -> list[SamplingRow]:
            return [PendingRow(r) if ahead else r for r, ahead in zip(requests, pending, strict=True)]

        indices = [self._row(request) for request in requests]
        index = torch.tensor(indices, dtype=torch.int64)
        gathered = {name: column[index] for name, column in self._columns.items()}
        penalized = (
            (gathered["repetition_penalty"] != 1.0)
            | (gathered["presence_penalty"] != 0.0)
            | (gathered["frequency_penalty"] != 0.0)
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
        temperature = gathered["temperature"]
        greedy = temperature == 0.0
        random_rows = ~greedy
        suppressed = None
        if bool((gathered["min_tokens"] > positions).any()):
            suppressed = _suppressed(rows(), self.vocab_size, self.device)
        device = self.device
        return SamplingBatch(
            temperature=temperature.to(device),
            top_p=gathered["top_p"].to(device),
            top_k=gathered["top_k"].to(device),
            min_p=gathered["min_p"].to(device),
            presence_penalty=gathered["presence_penalty"].to(device),
            frequency_penalty=gathered["frequency_penalty"].to(device),
            repetition_penalty=gathered["repetition_penalty"].to(device),
            seeds=gathered["seeds"].to(device),
            output_positions=positions.to(device),
            prompt_token_ids=None,
            output_token_ids=None,
            suppressed_token_ids=suppressed,
            num_logprobs=tuple(self._logprobs[i] for i in indices),
            vocab_size=self.vocab_size,
            all_greedy=bool(greedy.all()),
            all_random=bool(random_rows.all()),
            needs_top_k=bool(((gathered["top_k"] < self.vocab_size) & random_rows).any()),
            needs_top_p=bool(((gathered["top_p"] < 1.0) & random_rows).any()),
            needs_min_p=bool(((gathered["min_p"] > 0.0) & random_rows).any()),
            needs_penalties=False,
        )

    # ---- rows ---------------------------------------------------------------------------------

    def _row(self, request: Request) -> int:
        row, is_new = self._rows.row(request)
        if is_new:
            self._write(row, request)
        return row

    def _write(self, row: int, request: Request) -> None:
        params = request.sampling_params
        columns = self._columns
        temperature = 0.0 if params.temperature < GREEDY_TEMPERATURE_EPS else params.temperature
        columns["temperature"][row] = temperature
        columns["top_p"][row] = params.top_p
        columns["min_p"][row] = params.min_p
        columns["presence_penalty"][row] = params.presence_penalty
        columns["frequency_penalty"][row] = params.frequency_penalty
        columns["repetition_penalty"][row] = params.repetition_penalty
        columns["top_k"][row] = min(params.effective_top_k, self.vocab_size) or self.vocab_size
        columns["seeds"][row] = _wrap_int64(request.seed)
        columns["min_tokens"][row] = params.min_tokens
        self._logprobs[row] = params.logprobs

    def _grow(self, capacity: int) -> None:
        old = len(self._logprobs)
        for name in _FLOAT_COLUMNS + _INT_COLUMNS:
            dtype = torch.float32 if name in _FLOAT_COLUMNS else torch.int64
            column = torch.zeros(capacity, dtype=dtype)
            if old:
                column[:old] = self._columns[name]
            self._columns[name] = column
        self._logprobs.extend([None] * (capacity - old))
