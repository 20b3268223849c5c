"""Token ids to text for the tool-call parsers, with a family's markers split out by token id.

A marker that is one token in the vocabulary (`<tool_call>` in Qwen's, `[TOOL_CALLS]` in Mistral's)
is recognised by its id, before any decoding, so that no `skip_special_tokens` choice can hide it
and its text never reaches the content. Every other id is decoded incrementally with the
prefix/read-offset method (as `kvasir.runtime.engine.output.detokenizer` does): each token decodes a
short window of recent ids, and a window whose text ends in U+FFFD (a UTF-8 character split across
tokens) is held until the character completes. Markers that are not tokens stay in the text; the
parser matches them there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias

# A window this many tokens past its context is released even if it still ends in U+FFFD: a
# character is at most 4 bytes, so only invalid byte runs get here (same bound as the detokenizer).
_MAX_UNREAD_TOKENS = 16
_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    """What the parsers need of a tokenizer (`kvasir.runtime.loader.tokenizer.Tokenizer` and a bare
    `tokenizers.Tokenizer` both fit)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True)
class Marker:
    """A family marker seen in the output, as one token or as text; `text` is its spelling."""

    text: str


# What the parsers consume: one character of decoded text, or a marker.
Unit: TypeAlias = str | Marker


class TokenTextStream:
    """Turns token ids, one at a time, into decoded text and markers, in output order.

    Contract: `push(id)` returns the text this id completes (possibly "") and, when the id is a
    marker token, the Marker after any text held before it; `flush()` returns the text still held
    at the end. The result depends only on the ids, never on how a caller batches them.
    `skip_special_tokens` applies to the other ids (an end-of-sequence token, say).
    """

    def __init__(
        self, tokenizer: TokenDecoder, markers: Sequence[str], *, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.marker_ids: dict[int, Marker] = {}
        text_markers: list[str] = []
        for marker in markers:
            token_id = tokenizer.token_to_id(marker)
            if token_id is None:
                text_markers.append(marker)
            else:
                self.marker_ids[token_id] = Marker(marker)
        # Markers the parser must find in the decoded text, because the vocabulary spells them
        # with several tokens (SmolLM2 has no `<tool_call>` token, for one).
        self.text_markers: tuple[str, ...] = tuple(text_markers)
        # ids[:read] were turned into text already and are kept as context; ids[read:] not yet.
        # The context makes SentencePiece's leading spaces and byte fusing agree with one decode
        # of the whole output; it is kept across markers, which are not part of the text.
        self._ids: list[int] = []
        self._read = 0

    def push(self, token_id: int) -> list[Unit]:
        marker = self.marker_ids.get(token_id)
        if marker is not None:
            text = self._drain(force=True)
            return [text, marker] if text else [marker]
        self._ids.append(token_id)
        text = self._drain(force=False)
        return [text] if text else []

    def flush(self) -> str:
        return self._drain(force=True)

    def _drain(self, *, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        context = self._decode(self._ids[: self._read])
        text = self._decode(self._ids)
        if not force:
            if len(text) <= len(context):  # nothing new yet (a skipped special token, say)
                return ""
            if text.endswith(_REPLACEMENT) and len(self._ids) - self._read < _MAX_UNREAD_TOKENS:
                return ""
        new_text = text[len(context) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return new_text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))
