"""Incremental detokenization of one request's output, with stop strings.

Text is decoded with the prefix/read-offset method of vLLM and TGI: each step decodes only a short
window of recent tokens (a few already-emitted tokens for context, then the unread ones) and emits
the part that is new. A window whose text ends in U+FFFD is an unfinished multi-byte character
(byte-level or byte-fallback pieces) and is held until the character completes. The context tokens
make decoders that depend on neighbours (SentencePiece's leading space, byte fusing) agree with
decoding the whole sequence, and keep the per-token cost independent of the output length.

On top of the decoded text, output that could still turn into a stop string is held back; when a
stop string completes, the text is cut there (or just after it) and nothing more is released.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

# Prompt tokens decoded as context before the first output token (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5
# A window this many tokens past its context is released even if it still ends in U+FFFD: one
# character is at most 4 bytes, so only invalid byte runs (or long runs of skipped special tokens)
# get here, and without a cap they would make every later step decode a growing window.
_MAX_UNREAD_TOKENS = 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output token ids into text chunks; see `update` and `flush`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # Text that might still grow into a stop string is held back (not when the stop string is
        # part of the output anyway: then everything before a match is released regardless).
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        self._hold_limit = 0 if include_stop_str_in_output else max(self._longest_stop - 1, 0)
        # Token window: ids[:read] were already turned into text (context), ids[read:] not yet.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._context_text = self._decode(self._ids)
        # Released text as chunks (joined lazily), its last few characters (a stop string may begin
        # there and end in new text), and the decoded text not released yet.
        self._chunks: list[str] = []
        self._released_tail = ""
        self._held = ""
        self.stop_string_hit: str | None = None

    @property
    def text(self) -> str:
        """The output text released so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def finished(self) -> bool:
        """True once a stop string was hit; later tokens are ignored."""
        return self.stop_string_hit is not None

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Feed newly sampled tokens; return the text that can now be released (may be "")."""
        if self.finished:
            return ""
        new_text = ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            new_text += self._decode_new(force=False)
        return self._release(new_text, final=False)

    def flush(self) -> str:
        """At the end of the request: release held-back text and any unfinished character."""
        if self.finished:
            return ""
        return self._release(self._decode_new(force=True), final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, *, force: bool) -> str:
        """The text the unread tokens add after their context, "" while it is not complete yet."""
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._ids)
        overdue = len(self._ids) - self._read_offset > _MAX_UNREAD_TOKENS
        unfinished = window_text.endswith(_REPLACEMENT) or len(window_text) <= len(self._context_text)
        if unfinished and not (force or overdue):
            return ""
        # The window normally starts with the context's text; if a decoder rewrote the seam, fall
        # back to the common prefix so no character is emitted twice or lost.
        cut = len(self._context_text)
        if not window_text.startswith(self._context_text):
            cut = _common_prefix_length(window_text, self._context_text)
        new_text = window_text[cut:]
        # Slide the window: the tokens just read become the context of the next step.
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._context_text = self._decode(self._ids)
        return new_text

    def _release(self, new_text: str, *, final: bool) -> str:
        """Check the new text for stop strings, then release all but a possible stop prefix."""
        pending = self._held + new_text
        end = len(pending)
        match = self._find_stop(pending, len(new_text))
        if match is not None:
            stop, start = match  # start is relative to `pending`; < 0 means it began in released text
            self.stop_string_hit = stop
            end = start + len(stop) if self._include_stop else max(start, 0)
        elif not final:
            end -= self._held_suffix_length(pending)
        chunk, self._held = pending[:end], ("" if match is not None else pending[end:])
        if chunk:
            self._chunks.append(chunk)
            keep = self._longest_stop - 1
            self._released_tail = (self._released_tail + chunk)[-keep:] if keep > 0 else ""
        return chunk

    def _find_stop(self, pending: str, num_new: int) -> tuple[str, int] | None:
        """The stop string that completes first inside the new text, and where it starts in `pending`."""
        if not self._stops or num_new == 0:
            return None
        context = len(self._released_tail)
        haystack = self._released_tail + pending
        # A match ending before the new text would have been found earlier, so it must end inside it.
        search_from = max(0, len(haystack) - num_new - self._longest_stop + 1)
        best: tuple[int, int, str] | None = None  # (end, start, stop) in haystack coordinates
        for stop in self._stops:
            start = haystack.find(stop, search_from)
            if start == -1:
                continue
            # Tokenization must not decide which stop wins: the one a character-by-character
            # stream would complete first does, and among those the longest (earliest start).
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[2], best[1] - context)

    def _held_suffix_length(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        for length in range(min(self._hold_limit, len(pending)), 0, -1):
            tail = pending[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0


def _common_prefix_length(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
