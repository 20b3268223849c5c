"""Tool calling over HTTP: a chat request's `tools` / `tool_choice` turned into what the engine runs
(a grammar for `required` and a named tool) and what the answer carries (`message.tool_calls`, or
OpenAI's streamed tool-call deltas, and `finish_reason: "tool_calls"`).

    tool_choice  the template gets the tools  the output is                      read by
    none         yes (as vLLM)                free text                           nothing
    auto         yes                          free text, calls in the model's    the family's parser
                                              own format                          (--tool-call-parser)
    required     yes                          a JSON array of calls (grammar)     the json_array parser
    named        yes                          a JSON array of calls to that tool  the json_array parser

The declarations are checked, and the calls read from token ids, by `kvasir.runtime.tools`; this
module is only the HTTP side of them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvasir.runtime.server.responses import (
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from kvasir.runtime.structured.params import StructuredOutputs
from kvasir.runtime.tools.declarations import (
    ToolChoice,
    ToolDeclaration,
    parse_tool_choice,
    parse_tools,
    required_calls_schema,
)
from kvasir.runtime.tools.parsers import TOOL_CALL_PARSERS, ToolCallParser, parser_for_template
from kvasir.runtime.tools.strict_calls import strict_auto_outputs

if TYPE_CHECKING:
    from kvasir.runtime.engine.outputs import Completion, CompletionDelta
    from kvasir.runtime.loader.tokenizer import Tokenizer

# The parser of the calls a `required` or named tool_choice's grammar makes the model write.
CALLS_ARRAY_PARSER = "json_array"


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask of its generation and of its answer."""

    tools: list[ToolDeclaration]
    choice: ToolChoice
    template_tools: list[dict[str, Any]]  # as the chat template gets them (Hugging Face's convention)
    # required / named: the grammar of the calls (a JSON array); None under none and auto.
    structured_outputs: StructuredOutputs | None

    @property
    def forced(self) -> bool:
        """The output is a call, by grammar (`required` or a named tool)."""
        return self.choice.mode in ("required", "named")

    def parser_name(self, setting: str, chat_template: str | None) -> str | None:
        """The parser that reads this request's calls from the output; None: none is read (`none`).
        `setting` is `--tool-call-parser` (`auto`: the one the chat template's format calls for)."""
        if self.choice.mode == "none":
            return None
        if self.forced:
            return CALLS_ARRAY_PARSER
        return parser_for_template(chat_template or "") if setting == "auto" else setting


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """The request's tools checked (InvalidParameterError naming the field); None without tools
    (`tool_choice` none or auto then; `required` or a named tool without tools is a 400)."""
    declarations = parse_tools(tools)
    choice = parse_tool_choice(tool_choice, declarations, parallel_tool_calls)
    if not declarations:
        return None
    structured = None
    if choice.mode in ("required", "named"):
        structured = StructuredOutputs.json_schema(required_calls_schema(declarations, choice), "tools")
    return ToolPlan(declarations, choice, [tool.as_openai() for tool in declarations], structured)


def strict_auto_grammar(plan: ToolPlan, parser_name: str, tokenizer: Tokenizer) -> StructuredOutputs | None:
    """The grammar for `tool_choice: auto` with a `strict: true` tool: free text until the
    family's call trigger, then a call to a declared tool whose arguments follow that tool's
    schema (a lazily triggered grammar); None for a family without a call format. The chat route
    asks this only when some tool is strict, under `auto`, and no response_format or
    structured_outputs already constrains the output."""
    special = set(tokenizer.all_special_ids)

    def is_special_token(text: str) -> bool:
        return tokenizer.token_to_id(text) in special

    return strict_auto_outputs(plan.tools, parser_name, is_special_token)


def constrained_tool_schemas(plan: ToolPlan, grammar: StructuredOutputs | None) -> list[StructuredOutputs]:
    """Each tool schema the request's grammar enforces, as a grammar of its own named after its
    field (`tools[i].function.parameters`): compiled first, its errors point inside that tool's
    schema rather than into the generated grammar around it."""
    if grammar is None:
        return []
    enforced = [
        (index, tool)
        for index, tool in enumerate(plan.tools)
        if (plan.choice.mode == "named" and tool.name == plan.choice.name)
        or plan.choice.mode == "required"
        or (plan.choice.mode == "auto" and tool.strict)
    ]
    return [
        StructuredOutputs.json_schema(tool.parameters, f"tools[{index}].function.parameters")
        for index, tool in enforced
    ]


# ---- what the template gets -------------------------------------------------------------------


def template_arguments(arguments: Any) -> Any:
    """A call's arguments as chat templates read them: a dict when the text is a JSON object (many
    templates write `arguments | tojson` or iterate it), else as sent."""
    if not isinstance(arguments, str) or not arguments.lstrip().startswith("{"):
        return arguments
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


# ---- what the answer carries ------------------------------------------------------------------


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """`tool_calls` for a choice that made calls and stopped by itself (not cut by length)."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def new_parser(name: str, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> ToolCallParser:
    """A parser for one choice (`skip_special_tokens` as the request asks: its markers are kept)."""
    return TOOL_CALL_PARSERS[name](tokenizer, skip_special_tokens=skip_special_tokens)


@dataclass(frozen=True)
class ParsedChoice:
    """A finished choice's content and calls."""

    content: str | None
    tool_calls: list[ToolCall]


def parse_choice(
    parser_name: str,
    tokenizer: Tokenizer,
    choice: Completion,
    skip_special_tokens: bool = True,
) -> ParsedChoice:
    """A finished choice's token ids read by a fresh parser: its content and calls, OpenAI's shape.
    Content ends where the engine's text does when a stop string ended the choice (see
    `StreamedChoice`)."""
    parser = new_parser(parser_name, tokenizer, skip_special_tokens)
    parser.feed(list(choice.token_ids))
    parser.finish()
    result = parser.result()
    calls = [
        ToolCall(
            id=call.id or tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments)
        )
        for call in result.tool_calls
    ]
    if calls:
        return ParsedChoice(result.content or None, calls)
    content = result.content or ""
    if isinstance(choice.stop_reason, str):
        content = content[: len(choice.text)]
    return ParsedChoice(content, calls)


@dataclass
class StreamedChoice:
    """One choice's parser while it streams: its token ids in, content and OpenAI tool-call deltas out.

    The parser reads token ids, the engine's stop strings are found in its text: the token that
    completes a stop string may carry more text, and the engine holds back what could start one.
    So while a request with stop strings has made no call, content is released no further than
    the engine's text, and what is left when a stop string ends the choice is dropped: the
    content is then the engine's text, as without tools. (After a call, the two texts no longer
    line up: a stop string in the text after a call is not cut.)"""

    parser: ToolCallParser
    stop_strings: bool = False  # the request has stop strings
    made_calls: bool = False
    _ids: dict[int, str] = field(default_factory=dict)  # call index -> its id
    _text_chars: int = 0  # of the engine's text so far
    _released: int = 0  # content characters sent
    _pending: str = ""  # content the parser gave that the engine's text has not reached yet

    def feed(self, delta: CompletionDelta) -> tuple[str, list[ToolCallDelta]]:
        """The content and call deltas an engine delta's tokens (and, once finished, the parser's
        end) make. A call opens with its id, type and name (empty arguments); its arguments follow
        as fragments, each delta carrying only `index` and `function.arguments`."""
        parsed = [self.parser.feed(list(delta.token_ids))] if delta.token_ids else []
        if delta.finished:
            parsed.append(self.parser.finish())
        deltas: list[ToolCallDelta] = []
        for piece in parsed:
            for call in piece.tool_calls:
                if call.index not in self._ids:
                    self._ids[call.index] = call.id or tool_call_id()
                    self.made_calls = True
                    deltas.append(
                        ToolCallDelta(
                            index=call.index,
                            id=self._ids[call.index],
                            type="function",
                            function=FunctionCallDelta(name=call.name or "", arguments=""),
                        )
                    )
                if call.arguments:
                    last = deltas[-1] if deltas else None
                    if last is not None and last.index == call.index and last.id is None:
                        last.function.arguments += call.arguments
                    else:
                        deltas.append(
                            ToolCallDelta(
                                index=call.index, function=FunctionCallDelta(arguments=call.arguments)
                            )
                        )
        return self._content("".join(piece.content for piece in parsed), delta), deltas

    def _content(self, content: str, delta: CompletionDelta) -> str:
        if not self.stop_strings:
            return content
        self._text_chars += len(delta.text)
        self._pending += content
        if self.made_calls or (delta.finished and not isinstance(delta.stop_reason, str)):
            room = len(self._pending)  # no longer aligned with the text, or no stop string cut it
        else:
            room = max(self._text_chars - self._released, 0)
        released, self._pending = self._pending[:room], self._pending[room:]
        if delta.finished:
            self._pending = ""
        self._released += len(released)
        return released


def stream_choices(
    streamed: StreamedChoice, delta: CompletionDelta, logprobs: ChatLogprobs | None
) -> list[ChatStreamChoice]:
    """The stream choices one engine delta of a parsed choice makes: its content, then one per
    call delta (a call's opening and its arguments travel in separate chunks, as OpenAI sends
    them); the logprobs on the first, the finish reason on the last (`tool_calls` once it made
    calls and stopped). None when the parser holds everything back and nothing else is new."""
    content, calls = streamed.feed(delta)
    deltas = ([ChatDelta(content=content)] if content else []) + [
        ChatDelta(tool_calls=[call]) for call in calls
    ]
    if not deltas:
        if logprobs is None and delta.finish_reason is None:
            return []
        deltas = [ChatDelta()]
    choices = [ChatStreamChoice(index=delta.index, delta=item) for item in deltas]
    choices[0].logprobs = logprobs
    choices[-1].finish_reason = finish_reason(delta.finish_reason, streamed.made_calls)
    choices[-1].stop_reason = delta.stop_reason
    return choices
