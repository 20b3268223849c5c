"""Tool-call parsers, one per model family, chosen by name or from the model's chat template.

    parser = TOOL_CALL_PARSERS[parser_for_template(tokenizer.chat_template)](tokenizer)
    delta = parser.feed(new_token_ids)   # ParsedDelta: content and ToolCallDelta pieces
    ...
    delta = parser.finish()
    answer = parser.result()             # ParsedOutput: content and complete ToolCalls

"json_array" parses the constrained output of `tool_choice` "required" or a named function, for
any family; the others parse what a model writes on its own under "auto".
"""

from __future__ import annotations

from kvasir.runtime.tools.parsers.base import (
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
)
from kvasir.runtime.tools.parsers.hermes import HermesToolParser
from kvasir.runtime.tools.parsers.json_array import JsonArrayToolParser
from kvasir.runtime.tools.parsers.llama3_json import Llama3JsonToolParser
from kvasir.runtime.tools.parsers.mistral import MistralToolParser
from kvasir.runtime.tools.parsers.token_text import TokenDecoder

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "json_array": JsonArrayToolParser,
}

__all__ = [
    "TOOL_CALL_PARSERS",
    "ParsedDelta",
    "ParsedOutput",
    "TokenDecoder",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "parser_for_template",
]


def parser_for_template(chat_template: str | None) -> str:
    """The parser name for a model, from the text of its chat template.

    A template that renders tools shows the model the format it was trained to call in: Hermes'
    `<tool_call>`, Mistral's `[TOOL_CALLS]`, or Llama 3's `<|python_tag|>` / "parameters" with
    ipython messages. Hermes is checked first since Qwen's templates also mention "parameters".
    Anything else (no template, or one without tools) gets hermes: it is the format most
    fine-tunes and small models (SmolLM2, Qwen, Hermes, many merges) were trained on, its marker
    is unlikely in ordinary text, and without a marker its parser leaves the answer as content.
    """
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or (
        '"parameters"' in template and ("<|eom_id|>" in template or "ipython" in template)
    ):
        return "llama3_json"
    return "hermes"
