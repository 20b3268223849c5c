"""Strict tools under `tool_choice: auto`: the model may answer in text, but once it starts a call
(its family's trigger) the call is constrained to a declared tool with arguments valid against
that tool's schema. Tools not marked strict may still be called, with any JSON object.

The call's shape per family is the one its parser reads (`parsers/`); the grammar itself is built
by the structured-output layer from this plain description.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvasir.runtime.structured.params import CallFormat, StructuredOutputs
from kvasir.runtime.tools.declarations import ToolDeclaration

# What follows the trigger, as the family's parser reads it (`{name}`: the JSON-quoted name).
CALL_FORMATS = {
    "hermes": ("<tool_call>", '\n{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ("<|python_tag|>", '{"name": {name}, "parameters": ', "}"),
    "mistral": ("[TOOL_CALLS]", '[{"name": {name}, "arguments": ', "}]"),
}


def strict_auto_outputs(
    tools: Sequence[ToolDeclaration], family: str, is_special_token: Callable[[str], bool]
) -> StructuredOutputs | None:
    """The grammar for `auto` when a tool is strict (None when none is, or the family has no
    call format: the output is then only parsed). `is_special_token(text)` says whether the
    tokenizer has the trigger as one special token (the grammar then matches it by id)."""
    if not any(tool.strict for tool in tools) or family not in CALL_FORMATS:
        return None
    trigger, begin, end = CALL_FORMATS[family]
    call_format = CallFormat(trigger, begin, end, special_trigger=is_special_token(trigger))
    return StructuredOutputs.tool_calls(
        call_format, [(tool.name, tool.parameters if tool.strict else None) for tool in tools]
    )
