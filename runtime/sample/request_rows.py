"""Stable row numbers for live requests, for state kept across steps in row-indexed arrays.

The model runner keeps per-request state (sampling parameters, block tables) in arrays indexed by
row, written when a request joins and reused while it runs, so a step gathers its batch instead of
rebuilding it (vLLM's persistent input batch). This module only hands out the rows.

Rows are keyed by the `Request` object, not only its id: an id reused after a request finished
(an offline `generate` call after another) never inherits the old row and its stale contents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvasir.runtime.core.scheduler_output import RequestView


class RequestRows:
    """Rows 0..capacity-1 handed to requests; `grow(new_capacity)` is called before any row of
    the new range is used (and once at start-up with the initial capacity)."""

    def __init__(self, grow: Callable[[int], None], capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._grow_arrays = grow
        self._rows: dict[str, tuple[RequestView, int]] = {}
        self._free: list[int] = []
        self.capacity = 0
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, request: RequestView) -> tuple[int, bool]:
        """The request's row, and whether it is new (its contents are stale and must be written)."""
        entry = self._rows.get(request.request_id)
        if entry is not None and entry[0] is request:
            return entry[1], False
        if entry is not None:  # the id of a finished request, reused
            self._free.append(entry[1])
        if not self._free:
            self._sweep()
        if not self._free:
            self._grow(self.capacity * 2)
        row = self._free.pop()
        self._rows[request.request_id] = (request, row)
        return row, True

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished (unknown ids are ignored)."""
        for request_id in request_ids:
            entry = self._rows.pop(request_id, None)
            if entry is not None:
                self._free.append(entry[1])

    def _sweep(self) -> None:
        """Free the rows of requests that finished without their release reaching us."""
        for request_id, (request, row) in list(self._rows.items()):
            if request.is_finished:
                del self._rows[request_id]
                self._free.append(row)

    def _grow(self, capacity: int) -> None:
        self._grow_arrays(capacity)
        # Reversed, so rows are handed out low numbers first.
        self._free.extend(range(capacity - 1, self.capacity - 1, -1))
        self.capacity = capacity
