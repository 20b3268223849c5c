"""`tools`, `tool_choice` and `parallel_tool_calls` checked: every 400 names its field."""

from __future__ import annotations

from typing import Any

import pytest

from kvasir.runtime.sample.params import InvalidParameterError
from kvasir.runtime.tools.declarations import (
    MAX_TOOLS,
    ToolChoice,
    ToolDeclaration,
    parse_tool_choice,
    parse_tools,
)


def tool(name: str = "get_weather", **function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, **function}}


WEATHER = tool(
    "get_weather",
    description="Current weather",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    strict=True,
)


def test_tools_become_declarations() -> None:
    declarations = parse_tools([WEATHER, tool("now")])
    assert declarations[0] == ToolDeclaration(
        "get_weather", "Current weather", WEATHER["function"]["parameters"], strict=True
    )
    assert declarations[1] == ToolDeclaration("now", None, {"type": "object", "properties": {}}, False)
    assert declarations[0].parameters is not WEATHER["function"]["parameters"]  # a private copy
    assert declarations[0].as_openai() == WEATHER
    assert parse_tools(None) == [] and parse_tools([]) == []


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ({"type": "function"}, "tools"),
        ([tool(f"f{i}") for i in range(MAX_TOOLS + 1)], "tools"),
        ([WEATHER, "get_time"], "tools[1]"),
        ([{"type": "code_interpreter"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        ([WEATHER, tool("a"), tool("")], "tools[2].function.name"),
        ([tool("x" * 65)], "tools[0].function.name"),
        ([tool("get weather")], "tools[0].function.name"),
        ([tool("météo")], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": 7}}], "tools[0].function.name"),
        ([WEATHER, tool("get_weather")], "tools[1].function.name"),
        ([tool(description=3)], "tools[0].function.description"),
        ([tool(parameters=[])], "tools[0].function.parameters"),
        (
            [tool(parameters={"type": "object", "properties": {"a": {"type": 5}}})],
            "tools[0].function.parameters",
        ),
        ([tool(strict="yes")], "tools[0].function.strict"),
    ],
)
def test_each_bad_tool_names_its_field(tools: Any, param: str) -> None:
    with pytest.raises(InvalidParameterError) as raised:
        parse_tools(tools)
    assert raised.value.param == param


def test_the_name_rule_is_openais() -> None:
    names = ["a", "A-b_9", "x" * 64]
    assert [d.name for d in parse_tools([tool(n) for n in names])] == names


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "expected"),
    [
        (None, None, ToolChoice("auto")),
        ("auto", False, ToolChoice("auto", parallel=False)),
        ("none", None, ToolChoice("none")),
        ("required", True, ToolChoice("required")),
        ({"type": "function", "function": {"name": "now"}}, None, ToolChoice("named", "now")),
        ({"type": "function", "function": {"name": "now"}}, False, ToolChoice("named", "now", False)),
    ],
)
def test_tool_choice_resolves(tool_choice: Any, parallel: bool | None, expected: ToolChoice) -> None:
    assert parse_tool_choice(tool_choice, parse_tools([WEATHER, tool("now")]), parallel) == expected


def test_without_tools_the_choice_is_none() -> None:
    assert parse_tool_choice(None, [], None) == ToolChoice("none")
    assert parse_tool_choice("auto", [], None) == ToolChoice("none")


@pytest.mark.parametrize(
    ("tool_choice", "tools", "words"),
    [
        ({"type": "function", "function": {"name": "get_time"}}, [WEATHER], "'get_time'"),
        ({"type": "function", "function": {"name": "get_time"}}, [], "'get_time'"),
        ("required", [], "required"),
        ("always", [WEATHER], "'always'"),
        ({"type": "function", "name": "get_weather"}, [WEATHER], '"function": {"name": ...}'),
        ({"type": "function", "function": {}}, [WEATHER], "name"),
        (["get_weather"], [WEATHER], "'required'"),
    ],
)
def test_each_bad_tool_choice_names_tool_choice(tool_choice: Any, tools: list[Any], words: str) -> None:
    with pytest.raises(InvalidParameterError) as raised:
        parse_tool_choice(tool_choice, parse_tools(tools), None)
    assert raised.value.param == "tool_choice"
    assert words in raised.value.message


def test_parallel_tool_calls_must_be_a_boolean() -> None:
    with pytest.raises(InvalidParameterError) as raised:
        parse_tool_choice("auto", parse_tools([WEATHER]), "yes")  # type: ignore[arg-type]
    assert raised.value.param == "parallel_tool_calls"
