"""How long each phase of building the engine took: the server reports them as
`kvasir_time_to_ready_seconds{phase}`, so an operator sees what a cold start is made of (weights,
KV cache, kernel warm-up, CUDA graph capture) and the autoscaler learns the total."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StartupPhases:
    """Seconds per named phase, in the order the phases first ran (a repeated phase adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started
