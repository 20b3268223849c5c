"""A request's grammar state: which tokens may come next, advanced by each token the engine keeps.

One `GrammarState` per sequence (each choice of an `n > 1` request has its own), copied from the
compiled grammar's prototype matcher. The scheduler advances it with every token it appends
(`accept`) and ends the sequence once the grammar admits nothing more (`terminated`); the model
runner asks it for token bitmasks (`fill_bitmask`), including the rows that score speculative
drafts, which it walks and then rolls back exactly; the drafter trims drafts to the prefix the
grammar accepts (`valid_prefix`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import numpy as np

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one row of a token bitmask (bit t of the row allows token t)."""
    return (vocab_size + 31) // 32


class GrammarState:
    """An llguidance matcher for one sequence; used by one thread at a time (the engine's step)."""

    __slots__ = ("_matcher", "kind", "num_accepted")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str) -> None:
        self._matcher = matcher
        self.kind = kind
        self.num_accepted = 0

    def accept(self, token_id: int) -> None:
        """Advance past a token the sequence keeps. Every kept token was allowed by the mask, so a
        refusal is a bug; the state then ends the sequence rather than let it run unconstrained."""
        if not self._matcher.consume_token(token_id):
            logger.error("grammar refused token %d it had allowed: %s", token_id, self._matcher.get_error())
        self.num_accepted += 1

    @property
    def terminated(self) -> bool:
        """Nothing but EOS may follow (the grammar is complete and cannot grow), or it failed."""
        return self._matcher.is_stopped()

    @property
    def failed(self) -> bool:
        return self._matcher.is_error()

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (drafts) the grammar accepts in order from here; no state change."""
        if not token_ids:
            return 0
        return self._matcher.validate_tokens(list(token_ids))

    def fill_bitmask(self, bitmask: np.ndarray, first_row: int, drafts: Sequence[int] = ()) -> None:
        """Write the allowed tokens into rows `first_row ..` of `bitmask` [R, W] int32: the next
        token's, then for each draft the token after it, as if the drafts before were accepted.
        Drafts are walked and rolled back, so the state is unchanged. Rows past a draft the
        grammar refuses allow everything: verification stops at that draft before reading them."""
        words = bitmask.shape[1]
        row_bytes = words * 4
        base = bitmask.ctypes.data
        matcher = self._matcher
        matcher.unsafe_compute_mask_ptr(base + first_row * row_bytes, row_bytes)
        walked = 0
        for offset, draft in enumerate(drafts, start=1):
            if not matcher.try_consume_tokens([draft]):
                bitmask[first_row + offset : first_row + len(drafts) + 1] = -1
                break
            walked += 1
            matcher.unsafe_compute_mask_ptr(base + (first_row + offset) * row_bytes, row_bytes)
        if walked:
            matcher.rollback(walked)
