"""Hermes-style tool calls (Hermes 2/3, Qwen2.5, Qwen3, and most models trained on their format).

The model writes each call as a JSON object between markers, with content before, between and
after calls:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The arguments key may also be "parameters". `</tool_call>` is optional after the last call (some
models stop right after the object), and `</tool_call>` inside a JSON string is data, not an end.
"""

from __future__ import annotations

from kvasir.runtime.tools.parsers.base import ToolCallParser

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, content around them.

    After a call object the parser is back in content, where `</tool_call>` is dropped like any
    marker: so a missing end marker, or text between the object and it, is tolerated.
    """

    START_MARKERS = (TOOL_CALL_START,)
    OTHER_MARKERS = (TOOL_CALL_END,)
