"""Re-choose the CPU thread count while the engine runs, from the steps' own timings.

The default thread count (`runtime/threads.py`) is every CPU the process may use, which is the
fastest on cores it has to itself (two threads served 1.2-1.4x one on a quiet 2-core machine).
On cores shared with a busy neighbour every parallel region waits at its barrier for a thread the
scheduler has preempted, and one thread is faster: measured 2x with one busy process beside it,
and far more under heavier load (docs/benchmarks.md, "Kvasir's CPU thread default"). Which case
holds changes while a server runs, and a load sample at start-up says nothing about the next
hour, so the engine measures instead: it runs with the default, and every `exploit_steps` steps
it tries the other count for `probe_steps` steps. Steps are compared only with steps of the same
number of tokens (a decode step of 8 requests with another of 8); if the probe's median step is
clearly faster (below `margin` times the other's), the engine keeps the probed count, else it
goes back. On a quiet machine a probe costs under 1% of the steps (8 in 264, by arithmetic); on
a busy one the engine finds the better count within a few hundred steps. Only when the user did not choose (`--threads`,
`KVASIR_THREADS`, `OMP_NUM_THREADS`), and never on a GPU.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict, deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

# Step times kept per (thread count, tokens in the step).
HISTORY = 32


class ThreadTuner:
    """Chooses between `choices` (the default count first) from step timings: call `threads()`
    for the count the next step runs with and `observe(tokens, seconds)` after it."""

    def __init__(
        self,
        choices: tuple[int, ...],
        apply: Callable[[int], None],
        *,
        exploit_steps: int = 256,
        probe_steps: int = 8,
        margin: float = 0.85,
    ) -> None:
        if len(choices) != 2 or len(set(choices)) != 2 or min(choices) < 1:
            raise ValueError(f"choices must be two different thread counts, got {choices}")
        if exploit_steps < 1 or probe_steps < 1 or not 0 < margin <= 1:
            raise ValueError("exploit_steps and probe_steps must be positive and margin in (0, 1]")
        self.choices = choices
        self._apply = apply
        self._exploit_steps, self._probe_steps, self._margin = exploit_steps, probe_steps, margin
        self._current = choices[0]
        self._probing = False
        self._left = exploit_steps
        self._times: dict[tuple[int, int], deque[float]] = defaultdict(lambda: deque(maxlen=HISTORY))

    def threads(self) -> int:
        """The thread count the next step runs with."""
        return self._other() if self._probing else self._current

    def observe(self, tokens: int, seconds: float) -> None:
        """One finished step: its tokens and wall time. Starts or ends a probe when it is due."""
        self._times[(self.threads(), tokens)].append(seconds)
        self._left -= 1
        if self._left > 0:
            return
        if self._probing:
            self._decide()
        self._probing = not self._probing
        self._left = self._probe_steps if self._probing else self._exploit_steps
        if self._probing:  # an earlier probe's steps may describe another load than now
            for key in [key for key in self._times if key[0] == self._other()]:
                del self._times[key]
        self._apply(self.threads())

    def _other(self) -> int:
        return self.choices[1] if self._current == self.choices[0] else self.choices[0]

    def _decide(self) -> None:
        """After a probe: keep the probed count where it was clearly faster on comparable steps."""
        probed, current = self._other(), self._current
        ratios = [
            statistics.median(self._times[(probed, tokens)]) / statistics.median(times)
            for (threads, tokens), times in self._times.items()
            if threads == current and times and self._times.get((probed, tokens))
        ]
        if ratios and statistics.median(ratios) < self._margin:
            logger.info(
                "CPU threads: %d -> %d (its steps took %.2fx the time of %d threads' of the same size)",
                current, probed, statistics.median(ratios), current,
            )  # fmt: skip
            self._current = probed
            # What was measured with the old count no longer describes the machine.
            self._times = defaultdict(lambda: deque(maxlen=HISTORY))
