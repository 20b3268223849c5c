"""Mistral tool calls, in both of Mistral's formats.

Older models (Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo, Small 3.1) write `[TOOL_CALLS]` and a
JSON array of calls:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Newer ones (tokenizer v11 and later: Small 3.2, Magistral, Devstral) write each call as its name
and its arguments after `[ARGS]`, one `[TOOL_CALLS]` per call, and some put a call id after
`[CALL_ID]` (it is skipped: ids are ours, in OpenAI's style):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

Content may come before the first `[TOOL_CALLS]` and after the calls.
"""

from __future__ import annotations

import re

from kvasir.runtime.tools.parsers.base import longest_marker_prefix
from kvasir.runtime.tools.parsers.json_array import JsonArrayToolParser
from kvasir.runtime.tools.parsers.json_scan import JSON_WHITESPACE, JsonValueScanner, Scan
from kvasir.runtime.tools.parsers.token_text import Marker, TokenDecoder, Unit

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FIELD_SO_FAR = re.compile(r"\s*[a-zA-Z0-9_-]*\s*")
# A name or call id longer than this is not one: give up rather than buffer without bound.
_MAX_FIELD_CHARS = 128


class MistralToolParser(JsonArrayToolParser):
    """`[TOOL_CALLS][{...}, ...]` or `([TOOL_CALLS]name[CALL_ID]id?[ARGS]{...})+`, content around.

    The name form's arguments must be a JSON object; they stream as the model writes them.
    """

    START_MARKERS = (TOOL_CALLS,)
    OTHER_MARKERS = (ARGS, CALL_ID)

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, skip_special_tokens=skip_special_tokens)
        self._state = self._content_state
        self._field = ""  # the name or call id being read
        self._name = ""
        self._arguments: JsonValueScanner | None = None

    def _start_call(self, marker: str) -> None:
        self._begin_capture()
        self._state = self._after_marker

    def _after_marker(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == "[":
            self._state = self._array_item
        elif isinstance(unit, str):
            self._field = ""
            self._state = self._name_state
            self._name_state(unit)
        else:
            self._fail(unit)

    def _name_state(self, unit: Unit) -> None:
        marker = self._field_marker(unit)
        if marker is None:
            return
        self._name = self._field.strip()
        if not _NAME.fullmatch(self._name) or marker not in (ARGS, CALL_ID):
            self._fail(unit)
        elif marker == ARGS:
            self._state = self._before_arguments
        else:
            self._field = ""
            self._state = self._call_id_state

    def _call_id_state(self, unit: Unit) -> None:
        marker = self._field_marker(unit)
        if marker == ARGS:
            self._state = self._before_arguments
        elif marker is not None:
            self._fail(unit)

    def _field_marker(self, unit: Unit) -> str | None:
        """Adds `unit` to the name or call id being read; returns the marker that ends it, if
        `unit` is (or completes) one. Fails the call as soon as the field cannot be a name."""
        if isinstance(unit, Marker):
            return unit.text
        self._field += unit
        for marker in self._text_markers:
            if self._field.endswith(marker):
                self._field = self._field[: -len(marker)]
                return marker
        field = self._field[: len(self._field) - longest_marker_prefix(self._field, self._text_markers)]
        if len(field) > _MAX_FIELD_CHARS or not _FIELD_SO_FAR.fullmatch(field):
            self._fail(unit)
        return None

    def _before_arguments(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit != "{":
            self._fail(unit)
            return
        self._announce(self._name)
        self._arguments = JsonValueScanner()
        self._state = self._arguments_state
        self._arguments_state(unit)

    def _arguments_state(self, unit: Unit) -> None:
        scanner = self._arguments
        assert scanner is not None
        if isinstance(unit, Marker) and not scanner.in_string:
            self._fail(unit)
            return
        text = unit.text if isinstance(unit, Marker) else unit
        for char in text:
            step = scanner.push(char)
            if step is Scan.ERROR:
                self._fail(unit)
                return
            self._emit_arguments(char)
            if step is Scan.DONE:
                self._end_call()
                self._arguments = None
                self._to_content()
                return
