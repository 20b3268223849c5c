"""The byte-level shape bounds agree with the parsed JSON they stand for, and parsing a body never
fails with anything but a 400, at every nesting depth up to and past `json.loads`'s own limit, in
every field that takes a nested value."""

from __future__ import annotations

import json
import sys
from typing import Any
from unittest.mock import patch

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvasir.runtime.server import json_shape
from kvasir.runtime.server.errors import APIError, to_api_error
from kvasir.runtime.server.json_body import lone_surrogate_path, parse_body
from kvasir.runtime.server.json_shape import check_json_shape
from kvasir.runtime.server.printable import printable
from kvasir.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

# Text full of what a byte-level JSON walk could trip on: quotes, backslashes, brackets, separators.
TRICKY = st.text(st.sampled_from('"\\[]{},: a\u00e9\u2028\U0001f600') | st.characters(), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TRICKY,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TRICKY, inner, max_size=5),
    max_leaves=40,
)
SMALL_BOUNDS = {"MAX_DEPTH": 4, "MAX_CONTAINERS": 6, "MAX_VALUES": 12, "MAX_STRINGS": 10, "MAX_MEMBERS": 3}


def _shape(value: Any) -> dict[str, int]:
    """What the bounds count, from the parsed value: the reference the byte walk must agree with."""
    shape = {"depth": 0, "containers": 0, "values": 0, "strings": 0, "members": 0}
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, str):
            shape["strings"] += 1
        if isinstance(item, dict | list):
            shape["depth"] = max(shape["depth"], depth + 1)
            shape["containers"] += 1
            shape["values"] += len(item)
            if isinstance(item, dict):
                shape["members"] = max(shape["members"], len(item))
                shape["strings"] += len(item)
            pending.extend(
                (child, depth + 1) for child in (item.values() if isinstance(item, dict) else item)
            )
    return shape


def _within(shape: dict[str, int]) -> bool:
    return (
        shape["depth"] <= SMALL_BOUNDS["MAX_DEPTH"]
        and shape["containers"] <= SMALL_BOUNDS["MAX_CONTAINERS"]
        and shape["values"] <= SMALL_BOUNDS["MAX_VALUES"]
        and shape["strings"] <= SMALL_BOUNDS["MAX_STRINGS"]
        and shape["members"] <= SMALL_BOUNDS["MAX_MEMBERS"]
    )


@settings(max_examples=400, deadline=None)
@given(value=JSON_VALUES, ascii=st.booleans(), spaced=st.booleans())
def test_the_byte_walk_counts_what_json_loads_builds(value: Any, ascii: bool, spaced: bool) -> None:
    separators = (" , ", " : ") if spaced else (",", ":")
    body = json.dumps(value, ensure_ascii=ascii, separators=separators).encode("utf-8", "surrogatepass")
    try:
        with patch.multiple(json_shape, **SMALL_BOUNDS):  # small enough for examples to cross them
            check_json_shape(body)
        refused = False
    except APIError as error:
        assert error.status == 400 and error.code == "request_too_complex"
        refused = True
    assert refused != _within(_shape(value)), (body[:200], _shape(value))


# Every field that takes a nested value, on each route; DEPTH is replaced by the nested value.
NESTED_FIELDS: list[tuple[type[BaseModel], str, str]] = [
    (CompletionRequest, "metadata", '{"prompt": "hi", "metadata": DEPTH}'),
    (CompletionRequest, "prompt", '{"prompt": DEPTH}'),
    (CompletionRequest, "stop", '{"prompt": "hi", "stop": DEPTH}'),
    (CompletionRequest, "unknown", '{"prompt": "hi", "unknown": DEPTH}'),
    (ChatCompletionRequest, "messages", '{"messages": [{"role": "user", "content": DEPTH}]}'),
    (ChatCompletionRequest, "messages", '{"messages": [{"role": "user", "content": "x", "name": DEPTH}]}'),
    (ChatCompletionRequest, "chat_template_kwargs", '{"messages": [], "chat_template_kwargs": {"k": DEPTH}}'),
    (ChatCompletionRequest, "response_format", '{"messages": [], "response_format": {"type": "text", "json_schema": DEPTH}}'),
    (TokenizeRequest, "messages", '{"messages": [{"role": "user", "content": "x", "name": DEPTH}]}'),
    (DetokenizeRequest, "tokens", '{"tokens": DEPTH}'),
    (DetokenizeRequest, None, "DEPTH"),
]  # fmt: skip
PARSER_LIMIT = sys.getrecursionlimit() + 100  # json.loads itself gives up near the recursion limit


@pytest.mark.parametrize("model, field, template", NESTED_FIELDS)
def test_every_depth_up_to_past_the_parser_limit_is_a_400_or_valid(
    model: type[BaseModel], field: str | None, template: str
) -> None:
    for depth in range(1, PARSER_LIMIT):
        for opening, closing in (("[", "]"), ('{"a": ', "}")):
            nested = opening * depth + '"\\ud800"' + closing * depth  # the innermost text is not valid either
            body = template.replace("DEPTH", nested).encode()
            try:
                parse_body(body, model)
            except (APIError, RequestValidationError) as error:
                answer = to_api_error(error)
                assert answer.status == 400, (depth, answer.body())
                if depth > json_shape.MAX_DEPTH:
                    expected = field or ("a" if opening != "[" else None)  # the body itself nests
                    assert answer.code == "request_too_complex" and answer.param == expected, answer.body()


def test_the_lone_surrogate_walk_has_no_recursion() -> None:
    value: Any = "\ud800"
    for _ in range(100_000):
        value = [value]
    path = lone_surrogate_path({"metadata": value})
    assert path is not None and path[0] == "metadata" and len(path) == 100_001


def test_printable_escapes_every_line_break_control_and_surrogate() -> None:
    everything = "".join(map(chr, range(0x110000)))
    shown = printable(everything)
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0), 0x2028, 0x2029, 0x202E, 0xD800, 0xDFFF]:
        assert chr(code) not in shown
    assert shown.encode("utf-8")  # no lone surrogate left: it can be sent back and logged
    assert printable("a\nb", 1) == "a…" and printable("a\x1b[31m") == "a\\x1b[31m"
