"""`kvasir generate`'s input: JSONL request lines, every one checked before the model's weights
load, and every bad one reported with its line number.

Checked in two passes, both before any weights are read: the shape of each line (JSON, one of
`prompt`, `prompt_token_ids` or `messages`, known sampling parameters in range) with nothing
loaded, then what needs the model's config and tokenizer (token ids inside the vocabulary, prompt
plus max_tokens within the context length, a chat template that renders). A batch with a bad line
runs nothing: it is all or none, so a results file always answers its whole input."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from kvasir.runtime.engine.prompt_check import PreparedRequest, PromptCheck
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {"extra"}
_TUPLE_FIELDS = {"stop", "stop_token_ids"}


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
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    ):
        raise InputError(f"line {number}: 'messages' must be a list of objects with 'role' and 'content'")
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
        params = SamplingParams(**item)
    except InvalidParameterError as error:
        raise InputError(f"line {number}: {error}") from None
    except TypeError as error:  # a value of a type no field takes (a dict for max_tokens, ...)
        raise InputError(f"line {number}: {error}") from None
    return InputLine(number, params, prompt, token_ids, messages)


def prepare_lines(
    lines: Iterable[InputLine], check: PromptCheck
) -> tuple[list[PreparedRequest], list[InputError]]:
    """Each line tokenized and checked against the model (vocabulary, context length, chat
    template), and an error for each line that does not fit it."""
    prepared: list[PreparedRequest] = []
    errors: list[InputError] = []
    for line in lines:
        token_ids = line.token_ids
        try:
            if line.messages is not None:  # the server's order: a length bound, then the template
                chars = sum(len(str(m.get("content") or "")) for m in line.messages)
                check.check_prompt_chars(chars, "messages")
                token_ids = check.tokenizer.encode_chat(line.messages)
            request_id = str(line.number)
            prepared.append(check.prepare(request_id, line.text, line.params, prompt_token_ids=token_ids))
        except ValueError as error:  # InvalidParameterError, ChatTemplateError
            errors.append(InputError(f"line {line.number}: {error}"))
    return prepared, errors
