"""`kvasir generate`'s input: JSONL request lines, every one checked before the model's weights
load, and every bad one reported with its line number.

Checked in two passes, both before any weights are read: the shape of each line (JSON, one of
`prompt`, `prompt_token_ids` or `messages`, known sampling parameters in range, the server's
`response_format` or `structured_outputs`, and for `messages` its `tools`, `tool_choice` and
`parallel_tool_calls`) with nothing loaded, then what needs the model's config and tokenizer (token
ids inside the vocabulary, prompt plus max_tokens within the context length, a chat template that
renders, the model's tool-call format). A batch with a bad line
runs nothing: it is all or none, so a results file always answers its whole input."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from pydantic import ValidationError

from kvasir.runtime.engine.outputs import GenerationResult
from kvasir.runtime.engine.prompt_check import PreparedRequest, PromptCheck
from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.server.chat_size import text_chars
from kvasir.runtime.server.protocol import ResponseFormat
from kvasir.runtime.server.tool_calls import (
    ToolPlan,
    parse_choice,
    plan_tools,
    strict_auto_grammar,
    template_arguments,
)
from kvasir.runtime.structured.params import StructuredOutputs, parse_structured_outputs

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"extra", "structured_outputs"}
_TUPLE_FIELDS = {"stop", "stop_token_ids"}
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


class InputError(ValueError):
    """A line of the input file is not a valid request; the message starts with `line N:`."""


@dataclass(frozen=True)
class InputLine:
    """One request line: exactly one of its text, token ids or chat messages, and its parameters."""

    number: int
    params: SamplingParams
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: ToolPlan | None = None  # a `messages` line's tools, checked

    def tool_parser(self, tokenizer: Tokenizer) -> str | None:
        """The parser that reads this line's calls from its choices (the chat template's format
        under `auto`); None when its calls are not read."""
        return self.tools.parser_name("auto", tokenizer.chat_template) if self.tools is not None else None


def read_lines(stream: BinaryIO) -> tuple[list[InputLine], list[InputError]]:
    """Every request line of `stream`, and an error for each line that is not one. Bytes, decoded
    line by line, so that a line that is not UTF-8 is reported as that line."""
    lines: list[InputLine] = []
    errors: list[InputError] = []
    for number, raw in enumerate(stream, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            errors.append(InputError(f"line {number}: not UTF-8 text ({error.reason})"))
            continue
        if text.strip():
            try:
                lines.append(parse_line(number, text))
            except InputError as error:
                errors.append(error)
    return lines, errors


def parse_line(number: int, text: str) -> InputLine:
    """One JSONL line; InputError naming the line and the field."""
    try:
        item = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"line {number}: not valid JSON ({error.msg})") from None
    if not isinstance(item, dict):
        raise InputError(f"line {number}: expected a JSON object")
    prompt = item.pop("prompt", None)
    token_ids = item.pop("prompt_token_ids", None)
    messages = item.pop("messages", None)
    if sum(x is not None for x in (prompt, token_ids, messages)) != 1:
        raise InputError(f"line {number}: give exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
    if messages is not None and not (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and "role" in m and ("content" in m or "tool_calls" in m) for m in messages
        )
    ):
        raise InputError(
            f"line {number}: 'messages' must be a list of objects with 'role' and 'content' (or 'tool_calls')"
        )
    tool_fields = {name: item.pop(name) for name in _TOOL_FIELDS if name in item}
    response_format, structured_outputs = (
        item.pop("response_format", None),
        item.pop("structured_outputs", None),
    )
    if tool_fields and messages is None:
        raise InputError(f"line {number}: {', '.join(tool_fields)} only go with 'messages'")
    if prompt is not None and not isinstance(prompt, str):
        raise InputError(f"line {number}: 'prompt' must be a string")
    if token_ids is not None and not (
        isinstance(token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)
    ):
        raise InputError(f"line {number}: 'prompt_token_ids' must be a list of integers")
    unknown = sorted(set(item) - _PARAM_FIELDS)
    if unknown:
        raise InputError(f"line {number}: unknown field(s) {', '.join(unknown)}")
    if isinstance(item.get("stop"), str):
        item["stop"] = [item["stop"]]
    for name in _TUPLE_FIELDS & set(item):
        if isinstance(item[name], list):
            item[name] = tuple(item[name])
    try:
        structured = _structured(response_format, structured_outputs)
        tools = plan_tools(*(tool_fields.get(name) for name in _TOOL_FIELDS)) if tool_fields else None
        if tools is not None and tools.structured_outputs is not None:
            if structured is not None:
                raise InvalidParameterError(
                    "tool_choice",
                    "'required' or a named tool cannot be combined with response_format or structured_outputs",
                )
            structured = tools.structured_outputs
        params = SamplingParams(**item, structured_outputs=structured)
    except InvalidParameterError as error:
        raise InputError(f"line {number}: {error}") from None
    except TypeError as error:  # a value of a type no field takes (a dict for max_tokens, ...)
        raise InputError(f"line {number}: {error}") from None
    return InputLine(number, params, prompt, token_ids, messages, tools)


def _structured(response_format: Any, structured_outputs: Any) -> StructuredOutputs | None:
    """The grammar of a line's output, as the server reads these two fields (one at most)."""
    if structured_outputs is not None:
        if response_format is not None and response_format != {"type": "text"}:
            raise InvalidParameterError(
                "structured_outputs", "cannot be combined with response_format: give one of them"
            )
        # A schema as text nested deeper than json.loads goes is refused there, naming the field.
        return parse_structured_outputs(structured_outputs, "structured_outputs")
    if response_format is None:
        return None
    try:
        return ResponseFormat.model_validate(response_format).structured_outputs()
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        where = ".".join(str(part) for part in ("response_format", *first["loc"]))
        raise InvalidParameterError(where, first["msg"]) from None


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the chat template reads it: a call's arguments as a dict when they are a JSON
    object (as the server passes them)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and "arguments" in function:
            call = {**call, "function": {**function, "arguments": template_arguments(function["arguments"])}}
        converted.append(call)
    return {**message, "tool_calls": converted}


def prepare_lines(
    lines: Iterable[InputLine],
    check: PromptCheck,
    compile_grammar: Callable[[StructuredOutputs], object] | None = None,
) -> tuple[list[PreparedRequest], list[InputError]]:
    """Each line tokenized and checked against the model (vocabulary, context length, chat
    template, and with `compile_grammar` its grammar, which raises InvalidParameterError for one
    that is malformed or cannot be enforced), and an error for each line that does not fit it."""
    prepared: list[PreparedRequest] = []
    errors: list[InputError] = []
    for line in lines:
        token_ids = line.token_ids
        params = line.params
        try:
            if line.messages is not None:  # the server's order: a length bound, then the template
                chars = sum(
                    len(str(m.get("content") or "")) + text_chars(m.get("tool_calls")) for m in line.messages
                )
                variables: dict[str, Any] = {}
                if line.tools is not None:
                    chars += text_chars(line.tools.template_tools)
                    variables["tools"] = line.tools.template_tools
                check.check_prompt_chars(chars, "messages")
                messages = [_template_message(m) for m in line.messages]
                token_ids = check.tokenizer.encode_chat(messages, **variables)
                params = _tool_params(line, check.tokenizer)
            request_id = str(line.number)
            prepared.append(check.prepare(request_id, line.text, params, prompt_token_ids=token_ids))
            if compile_grammar is not None and params.structured_outputs is not None:
                compile_grammar(params.structured_outputs)  # the engine's compile cache may keep it
        except ValueError as error:  # InvalidParameterError, ChatTemplateError
            errors.append(InputError(f"line {line.number}: {error}"))
    return prepared, errors


def _tool_params(line: InputLine, tokenizer: Tokenizer) -> SamplingParams:
    """A line's parameters with the grammar its strict tools under `auto` ask for (the server's hook)."""
    tools, params = line.tools, line.params
    parser = line.tool_parser(tokenizer)
    if tools is None or parser is None or tools.forced or params.structured_outputs is not None:
        return params
    if not any(tool.strict for tool in tools.tools):
        return params
    grammar = strict_auto_grammar(tools, parser, tokenizer)
    return params if grammar is None else dataclasses.replace(params, structured_outputs=grammar)


def choice_tool_calls(
    line: InputLine, tokenizer: Tokenizer, result: GenerationResult
) -> list[list[dict[str, Any]] | None]:
    """Each choice's tool calls as the server answers them (`[{"id", "type", "function": {"name",
    "arguments"}}]`), read from its token ids; None for each when the line's calls are not read."""
    parser = line.tool_parser(tokenizer)
    if parser is None:
        return [None] * len(result.choices)
    return [
        [
            call.model_dump()
            for call in parse_choice(parser, tokenizer, choice, line.params.skip_special_tokens).tool_calls
        ]
        for choice in result.choices
    ]
