"""The tool-call parser interface, its results, and the machinery every family shares.

One parser object follows one choice's output. It takes token ids (`feed`, then `finish`) and gives
OpenAI's streaming shape: content text, and per call a first delta carrying its id and name, then
argument fragments. `result()` is the whole answer, built by the same state machine, so a streamed
answer and a non-streamed one agree exactly whatever the chunking of the ids.

How the text is split (the same for every family):

- Content: everything outside calls. A family's markers are never content; whitespace before a
  marker is dropped, whitespace after a call (or a failed call's marker) too unless content came
  before it, and trailing whitespace when the answer has calls. Text that could be the start of a marker spelled in several tokens is held
  back until it is known not to be one.
- Arguments: the exact characters the model wrote for the arguments value (see `json_scan`). A
  call is announced, and its arguments streamed, only once its name is known and its arguments
  have begun; a call that turns out malformed before that falls back to content: the text after
  its start marker is handled as content (markers in it keep their meaning). Streamed text
  cannot be taken back, so a call that breaks later (truncated by max_tokens, say) keeps the
  arguments it had, and its text from the breaking point on is handled as content.
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from kvasir.runtime.tools.parsers.json_scan import JSON_WHITESPACE, CallObjectScanner, Scan
from kvasir.runtime.tools.parsers.token_text import Marker, TokenDecoder, TokenTextStream, Unit


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is JSON text (as the model wrote it; usually an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index` (0-based within the choice): the first carries `id` and `name`."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ParsedDelta:
    """What one `feed`/`finish` added. Content and calls of one delta come in that order when both
    are present (a delta does not record how they interleaved; joined, they are still exact)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedOutput:
    """The whole answer: `content` is None when it is empty and there are calls (as OpenAI's)."""

    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    """A call id in OpenAI's style: "call_" and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class _CallRecord:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolCallParser:
    """Splits one choice's output into content and tool calls; subclasses are the model families.

    Contract: call `feed` with the ids as they come, then `finish` once; `result()` is complete
    after `finish` (before it, it is what has been parsed so far). Not thread-safe: one per choice.
    `skip_special_tokens` applies to ids that are not the family's markers.
    """

    # Markers that open a call where content is expected, and the family's other markers.
    START_MARKERS: ClassVar[tuple[str, ...]] = ()
    OTHER_MARKERS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True) -> None:
        markers = self.START_MARKERS + self.OTHER_MARKERS
        self._tokens = TokenTextStream(tokenizer, markers, skip_special_tokens=skip_special_tokens)
        self._text_markers = self._tokens.text_markers
        self._content: list[str] = []
        self._calls: list[_CallRecord] = []
        self._delta_content: list[str] = []
        self._delta_calls: list[ToolCallDelta] = []
        self._held = ""  # content not released yet: whitespace, or a possible marker's start
        # A call ended: whitespace before the next content is dropped if there is no content yet
        # (otherwise it separates the content before the call from the content after it).
        self._trim_leading = False
        self._queue: deque[Unit] = deque()
        # Units since the start of the call being parsed, replayed as content if it fails before
        # it is announced; None outside calls.
        self._capture: list[Unit] | None = None
        self._open: _CallRecord | None = None  # the call being parsed, once announced
        self._scanner: CallObjectScanner | None = None
        self._state: Callable[[Unit], None] = self._content_state
        self._finished = False

    def feed(self, token_ids: Sequence[int]) -> ParsedDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        for token_id in token_ids:
            self._run(self._tokens.push(token_id))
        return self._take_delta()

    def finish(self) -> ParsedDelta:
        """Flush: resolve an unfinished call (see the module docstring) and release held content."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._run([self._tokens.flush()])
        while self._capture is not None:
            if self._open is None:
                self._fail(None)
                self._run([])
            else:
                self._end_call()
        self._state = self._content_state
        held, self._held = self._held, ""
        self._emit_content(held.rstrip() if self._calls else held)
        return self._take_delta()

    def result(self) -> ParsedOutput:
        calls = [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self._calls]
        content = "".join(self._content)
        return ParsedOutput(None if not content and calls else content, calls)

    # -- family hooks ------------------------------------------------------------------------

    def _start_call(self, marker: str) -> None:
        """Content reached start marker `marker`: begin a capture and set the next state.
        Default: one call object follows the marker (Hermes, Llama 3), whitespace before it."""
        self._begin_capture()
        self._state = self._before_object

    def _before_object(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == "{":
            self._begin_object(unit)
        else:
            self._fail(unit)

    def _after_object(self) -> None:
        """A call object ended; what may follow it. Default: content."""
        self._to_content()

    # -- shared machinery --------------------------------------------------------------------

    def _run(self, pieces: Sequence[Unit]) -> None:
        for piece in pieces:
            if isinstance(piece, Marker):
                self._queue.append(piece)
            else:
                self._queue.extend(piece)
        while self._queue:
            unit = self._queue.popleft()
            if self._capture is not None:
                self._capture.append(unit)
            self._state(unit)

    def _content_state(self, unit: Unit) -> None:
        if isinstance(unit, Marker):
            self._release_held()
            self._on_marker(unit.text)
            return
        self._held += unit
        for marker in self._text_markers:
            if self._held.endswith(marker):
                self._held = self._held[: -len(marker)]
                self._release_held()
                self._on_marker(marker)
                return
        # Hold back what could still become a marker, and whitespace that may turn out to sit
        # just before one.
        keep = longest_marker_prefix(self._held, self._text_markers)
        text = self._held[: len(self._held) - keep]
        cut = len(text.rstrip())
        self._emit_content(text[:cut])
        self._held = self._held[cut:]

    def _on_marker(self, marker: str) -> None:
        if marker in self.START_MARKERS:
            self._start_call(marker)
        # Any other marker met where content is expected is dropped: marker text is never content.

    def _release_held(self) -> None:
        """A marker follows the held text: release it, less its trailing whitespace."""
        held, self._held = self._held, ""
        self._emit_content(held.rstrip())

    def _emit_content(self, text: str) -> None:
        if self._trim_leading and not self._content:
            text = text.lstrip()
            self._trim_leading = not text
        if text:
            self._content.append(text)
            self._delta_content.append(text)

    def _to_content(self, unit: Unit | None = None) -> None:
        """Back to content after a call, `unit` (if any) handled there first."""
        self._state = self._content_state
        self._trim_leading = True
        if unit is not None:
            self._queue.appendleft(unit)

    def _begin_capture(self, *units: Unit) -> None:
        """A call starts (its start marker, if any, is not part of it); `units` are already its."""
        if self._capture is None:
            self._capture = list(units)

    def _begin_object(self, unit: Unit) -> None:
        """`unit` ("{") starts a call object; parse it with the shared object state."""
        self._scanner = CallObjectScanner()
        self._state = self._object_state
        self._object_state(unit)

    def _object_state(self, unit: Unit) -> None:
        scanner = self._scanner
        assert scanner is not None
        if isinstance(unit, Marker) and not scanner.in_string:
            self._fail(unit)
            return
        # A marker inside a string is data; no marker has a quote or backslash, so the string
        # goes on past it.
        for char in unit.text if isinstance(unit, Marker) else unit:
            step = scanner.push(char)
            if step is Scan.ERROR:
                self._fail(unit)
                return
            if self._open is None and scanner.header_ready:
                assert scanner.name is not None
                self._announce(scanner.name)
            arguments = scanner.take_arguments()
            if arguments:
                self._emit_arguments(arguments)
            if step is Scan.DONE:
                self._end_call()
                self._after_object()
                return

    def _announce(self, name: str) -> None:
        call = _CallRecord(new_call_id(), name)
        self._delta_calls.append(ToolCallDelta(len(self._calls), call.id, name, ""))
        self._calls.append(call)
        self._open = call

    def _emit_arguments(self, text: str) -> None:
        assert self._open is not None
        self._open.arguments.append(text)
        self._delta_calls.append(ToolCallDelta(len(self._calls) - 1, None, None, text))

    def _end_call(self) -> None:
        self._capture = None
        self._open = None
        self._scanner = None

    def _fail(self, unit: Unit | None) -> None:
        """The call being parsed is malformed at `unit` (None: the output ended there). Before the
        call was announced, everything captured is handled again as content; after, `unit` is."""
        if self._capture is not None and self._open is None:
            replay = self._capture
        else:
            replay = [] if unit is None else [unit]
        self._end_call()
        self._state = self._content_state
        self._trim_leading = True
        self._queue.extendleft(reversed(replay))

    def _take_delta(self) -> ParsedDelta:
        groups: list[tuple[ToolCallDelta, list[str]]] = []
        for delta in self._delta_calls:  # merge a call's consecutive pieces into one delta
            if groups and groups[-1][0].index == delta.index and delta.id is None:
                groups[-1][1].append(delta.arguments)
            else:
                groups.append((delta, [delta.arguments]))
        calls = [ToolCallDelta(d.index, d.id, d.name, "".join(parts)) for d, parts in groups]
        delta_out = ParsedDelta("".join(self._delta_content), calls)
        self._delta_content.clear()
        self._delta_calls.clear()
        return delta_out


def longest_marker_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper start of one of `markers`."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best
