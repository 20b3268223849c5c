"""Prompt lookup ("ngram") drafting: continue the context the way it continued before.

When the last n tokens occurred earlier in the prompt or output, the tokens that followed that
occurrence are a cheap guess for what follows now: code edits, extraction and summaries copy
long runs of their input. No model runs; a miss proposes nothing and costs nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Finds the longest suffix n-gram (min_n <= n <= max_n) seen earlier; proposes what followed."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts following the most recent earlier match of the longest suffix."""
        length = len(token_ids)
        if num_tokens < 1 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows starting at 0 .. length-n-1: every earlier n-gram that has a continuation.
            windows = sliding_window_view(tokens[: length - 1], n)
            # Cheap pre-filter on the last token before comparing whole windows.
            candidates = np.flatnonzero(windows[:, -1] == suffix[-1])
            if candidates.size == 0:
                continue
            matches = candidates[(windows[candidates] == suffix).all(axis=1)]
            if matches.size:
                # The most recent occurrence: in an edit, the nearby copy is the one being followed.
                start = int(matches[-1]) + n
                return token_ids[start : start + num_tokens]
        return []
