"""Block tables kept across steps: a step writes only the blocks allocated since the previous one.

Rebuilding the step's padded block table from every request's block list costs time in the
number of blocks held (about 0.2 ms at batch 256 with 512-token contexts, growing with context);
nearly all of it is the same as last step. Here each request owns a row of a persistent array:
blocks are appended as the scheduler allocates them, and a step's table is one gather of its rows.

A request's block list only grows while it holds blocks; it is freed when the request finishes
(a new `Request` object, so a new row, if its id comes back) or is preempted (its preemption
count changes, and the row is written afresh from its new blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kvasir.runtime.core.scheduler_output import ScheduledRequest
from kvasir.runtime.sample.request_rows import RequestRows


class PersistentBlockTable:
    """Row-indexed block ids (int32, zero past each row's blocks), grown in rows and columns."""

    def __init__(self, capacity: int = 64, max_blocks: int = 16) -> None:
        self._table = np.zeros((0, max_blocks), dtype=np.int32)
        # Per row, plain lists (cheaper than numpy scalars to read once per request and step).
        self._num_written: list[int] = []
        self._epoch: list[int] = []  # the request's preemption count when the row was written
        self._rows = RequestRows(self._grow_rows, capacity)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        self._rows.release(request_ids)

    def gather(self, scheduled: Sequence[ScheduledRequest]) -> np.ndarray:
        """The step's block table: one row per scheduled request, as wide as the longest."""
        rows = np.empty(len(scheduled), dtype=np.int64)
        widest = 0
        for i, item in enumerate(scheduled):
            rows[i] = self._update(item)
            widest = max(widest, len(item.block_ids))
        return self._table[rows, :widest]

    def _update(self, item: ScheduledRequest) -> int:
        """Bring the request's row up to its block list; returns the row."""
        request, block_ids = item.request, item.block_ids
        row, is_new = self._rows.row(request)
        written = self._num_written[row]
        if is_new or self._epoch[row] != request.num_preemptions or written > len(block_ids):
            self._table[row] = 0  # zero padding past the blocks, as a freshly built table has
            self._epoch[row] = request.num_preemptions
            written = 0
        if written < len(block_ids):
            if len(block_ids) > self._table.shape[1]:
                self._grow_columns(len(block_ids))
            self._table[row, written : len(block_ids)] = block_ids[written:]
            self._num_written[row] = len(block_ids)
        return row

    def _grow_rows(self, capacity: int) -> None:
        old = self._table.shape[0]
        table = np.zeros((capacity, self._table.shape[1]), dtype=np.int32)
        table[:old] = self._table
        self._table = table
        self._num_written.extend([0] * (capacity - old))
        self._epoch.extend([0] * (capacity - old))

    def _grow_columns(self, needed: int) -> None:
        width = max(needed, 2 * self._table.shape[1])
        table = np.zeros((self._table.shape[0], width), dtype=np.int32)
        table[:, : self._table.shape[1]] = self._table
        self._table = table
