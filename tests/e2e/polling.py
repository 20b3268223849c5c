"""Bounded waiting for the end-to-end tests: poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Every wait in the suite is bounded; generous for a loaded 2-core machine running a control plane.
TIMEOUT = 60.0


def wait_for(probe: Callable[[], T | None], what: str, timeout: float = TIMEOUT, interval: float = 0.2) -> T:
    """Call `probe` until it returns something truthy and return it; TimeoutError naming `what` after
    `timeout` seconds (with the last value seen, so a failure says how far it got)."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} (last seen: {last!r})")
        time.sleep(interval)
