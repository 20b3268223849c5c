"""Sampling parameters kept across steps in row-indexed tensors (vLLM's persistent input batch).

`SamplingBatch.build` packs every request's parameters into fresh tensors each step: about 0.9 ms
of Python at batch 256 (docs/benchmarks.md). Most of that is the same every step. Here a request
gets a row when it first samples and keeps it until it finishes; its parameters are written once.
A step's batch is then one gather per column by the step's row indices, plus the parts that do
change every step (the output position each row samples at, and min_tokens suppression).

Rows are keyed by the `Request` object, not only its id, so an id reused after a request finished
(an offline `generate` call after another) never inherits the old row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvasir.runtime.core.request import Request
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
        self._rows: dict[str, tuple[Request, int]] = {}
        self._free: list[int] = []
        self._capacity = 0
        self._columns: dict[str, torch.Tensor] = {}
        self._logprobs: list[int | None] = []
        self._grow(capacity)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished."""
        for request_id in request_ids:
            entry = self._rows.pop(request_id, None)
            if entry is not None:
                self._free.append(entry[1])

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
        entry = self._rows.get(request.request_id)
        if entry is not None and entry[0] is request:
            return entry[1]
        if entry is not None:  # the id of a finished request, reused: its row is stale
            self._free.append(entry[1])
        if not self._free:
            self._sweep()
        if not self._free:
            self._grow(self._capacity * 2)
        row = self._free.pop()
        self._write(row, request)
        self._rows[request.request_id] = (request, row)
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

    def _sweep(self) -> None:
        """Free the rows of requests that finished without their release reaching us."""
        for request_id, (request, row) in list(self._rows.items()):
            if request.is_finished:
                del self._rows[request_id]
                self._free.append(row)

    def _grow(self, capacity: int) -> None:
        old = self._capacity
        for name in _FLOAT_COLUMNS + _INT_COLUMNS:
            dtype = torch.float32 if name in _FLOAT_COLUMNS else torch.int64
            column = torch.zeros(capacity, dtype=dtype)
            if old:
                column[:old] = self._columns[name]
            self._columns[name] = column
        self._logprobs.extend([None] * (capacity - old))
        self._free.extend(range(capacity - 1, old - 1, -1))
        self._capacity = capacity
