"""The output of constrained decoding for `tool_choice` "required" or a named function.

The grammar built from `required_calls_schema` makes the model write exactly a JSON array of calls,
with no content:

    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Whitespace around the array and its items is allowed. Output that is not such an array (which
the grammar rules out, except when max_tokens cuts it short) falls back to content like any
malformed call. The array states here are shared with the Mistral parser, whose older format is
the same array after `[TOOL_CALLS]`.
"""

from __future__ import annotations

from kvasir.runtime.tools.parsers.base import ToolCallParser
from kvasir.runtime.tools.parsers.json_scan import JSON_WHITESPACE
from kvasir.runtime.tools.parsers.token_text import TokenDecoder, Unit


class JsonArrayToolParser(ToolCallParser):
    """`[{"name": ..., "arguments": {...}}, ...]`, the whole output; items may be empty (`[]`)."""

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, skip_special_tokens=skip_special_tokens)
        self._state = self._array_open

    def _start_call(self, marker: str) -> None:
        raise AssertionError("the json_array format has no markers")

    def _array_open(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == "[":
            self._begin_capture(unit)
            self._state = self._array_item
        else:
            self._fail(unit)

    def _array_item(self, unit: Unit) -> None:
        """After "[" or ",": the next call object, or "]" (a trailing comma is tolerated)."""
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == "{":
            self._begin_capture(unit)
            self._begin_object(unit)
        elif unit == "]":
            self._end_call()
            self._to_content()
        else:
            self._fail(unit)

    def _after_object(self) -> None:
        self._state = self._array_next

    def _array_next(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == ",":
            self._state = self._array_item
        elif unit == "]":
            self._to_content()
        else:
            self._fail(unit)
