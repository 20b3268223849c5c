"""The grammar of free text with constrained tool calls (strict tools under `tool_choice: auto`).

The model writes what it likes until a call's trigger (Hermes' `<tool_call>`, Llama 3's
`<|python_tag|>`, Mistral's `[TOOL_CALLS]`); from there the call must name a declared tool and
its arguments must follow that tool's schema (any JSON object for a tool that is not strict),
then the call closes and free text may resume. llguidance's lazy lexemes start the constrained
part only at the trigger, so the text before it costs nothing.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions


def tool_calls_lark(value: str, whitespace: JsonCompileOptions) -> str:
    """llguidance grammar text for a `tool_calls` spec's value (`StructuredOutputs.tool_calls`)."""
    spec = json.loads(value)
    call = spec["format"]
    tags = []
    for tool in spec["tools"]:
        schema = dict(tool["schema"] or {"type": "object"})
        # The whitespace bound of every JSON grammar holds inside tool arguments too.
        schema["x-guidance"] = whitespace
        tags.append(
            llguidance.StructTag(
                trigger=call["trigger"],
                begin=call["trigger"] + call["begin"].replace("{name}", json.dumps(tool["name"])),
                grammar=schema,
                end=call["end"],
            )
        )
    return llguidance.StructTag.to_grammar(tags, assume_special=bool(spec["special_trigger"]))
