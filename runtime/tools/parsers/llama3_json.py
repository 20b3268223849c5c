"""Llama 3.1/3.2/3.3 JSON tool calls (the "JSON based tool calling" of Meta's prompt format).

The model answers with calls only, optionally after `<|python_tag|>`, several separated by ";":

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The arguments key is "parameters" (also "arguments", which some fine-tunes write). Without the
tag, an answer is a call list only if its first non-blank character is "{": an answer such as
`{"city": "Paris"}` (JSON that is not a call) then falls back to content, held back until its
object closes. A tag later in an answer also starts calls; text after the calls is content.
"""

from __future__ import annotations

from kvasir.runtime.tools.parsers.base import ToolCallParser
from kvasir.runtime.tools.parsers.json_scan import JSON_WHITESPACE
from kvasir.runtime.tools.parsers.token_text import TokenDecoder, Unit

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolCallParser):
    """`[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*`."""

    START_MARKERS = (PYTHON_TAG,)

    def __init__(self, tokenizer: TokenDecoder, *, skip_special_tokens: bool = True) -> None:
        super().__init__(tokenizer, skip_special_tokens=skip_special_tokens)
        self._state = self._first_state  # until the first character that is not whitespace

    def _first_state(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            self._held += unit  # released as content unless a call follows
            return
        self._state = self._content_state
        if unit == "{":
            self._held = ""
            self._begin_capture(unit)
            self._begin_object(unit)
        else:
            self._content_state(unit)

    def _after_object(self) -> None:
        self._state = self._after_call

    def _after_call(self, unit: Unit) -> None:
        """Between calls: whitespace, then ";" and the next call; anything else is content."""
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == ";":
            self._state = self._after_separator
        else:
            self._to_content(unit)

    def _after_separator(self, unit: Unit) -> None:
        if isinstance(unit, str) and unit in JSON_WHITESPACE:
            return
        if unit == "{":
            self._begin_capture(unit)
            self._begin_object(unit)
        else:
            self._to_content(unit)
