"""`required_calls_schema`: only valid call arrays validate, `$defs` of tool schemas included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from kvasir.runtime.sample.params import InvalidParameterError
from kvasir.runtime.tools.declarations import (
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    required_calls_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
# A tool whose schema refers to its own definitions, one of them recursive, old and new spelling.
ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "parameters": {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                "ship_to": {"$ref": "#/definitions/Address"},
            },
            "required": ["items"],
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string"},
                        "parts": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
                    },
                    "required": ["sku"],
                }
            },
            "definitions": {
                "Address": {"type": "object", "required": ["zip"], "properties": {"zip": {"type": "string"}}}
            },
        },
    },
}
# Another tool with a definition of the same name: the two must not collide once hoisted.
TAG = {
    "type": "function",
    "function": {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "$defs": {"Item": {"type": "integer"}},
        },
    },
}
# A tree: a reference to the schema's own root.
TREE = {
    "type": "function",
    "function": {
        "name": "tree",
        "parameters": {
            "type": "object",
            "properties": {
                "label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
            "required": ["label"],
        },
    },
}


def validator(
    tools: list[dict[str, Any]], tool_choice: Any = "required", parallel: bool | None = None
) -> Draft202012Validator:
    declarations = parse_tools(tools)
    schema = required_calls_schema(declarations, parse_tool_choice(tool_choice, declarations, parallel))
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_required_accepts_calls_of_any_tool_with_valid_arguments() -> None:
    check = validator([WEATHER, NOW])
    assert check.is_valid([call("get_weather", {"city": "Paris"})])
    assert check.is_valid([call("now", {}), call("get_weather", {"city": "Oslo", "unit": "c"})])


@pytest.mark.parametrize(
    "calls",
    [
        [],
        {"name": "now", "arguments": {}},
        [call("get_time", {})],
        [call("get_weather", {})],
        [call("get_weather", {"city": "Paris", "unit": "k"})],
        [call("get_weather", {"city": "Paris", "extra": 1})],
        [{"name": "now"}],
        [{"name": "now", "arguments": {}, "id": "x"}],
    ],
)
def test_required_refuses_anything_else(calls: Any) -> None:
    assert not validator([WEATHER, NOW]).is_valid(calls)


def test_parallel_tool_calls_false_allows_one_call() -> None:
    check = validator([WEATHER, NOW], parallel=False)
    assert check.is_valid([call("now", {})])
    assert not check.is_valid([call("now", {}), call("now", {})])


def test_a_named_tool_allows_only_that_tool() -> None:
    check = validator([WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}})
    assert check.is_valid([call("get_weather", {"city": "Paris"})])
    assert not check.is_valid([call("now", {})])


def test_name_comes_before_arguments() -> None:
    schema = required_calls_schema(parse_tools([WEATHER]), ToolChoice("required"))
    assert list(schema["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert "$defs" not in schema


def test_definitions_are_hoisted_and_still_resolve() -> None:
    check = validator([ORDER, TAG])
    schema = check.schema
    assert set(schema["$defs"]) == {"order.Item", "order.Address", "tag.Item"}
    good_order = {"items": [{"sku": "a", "parts": [{"sku": "b"}]}], "ship_to": {"zip": "0150"}}
    assert check.is_valid([call("order", good_order), call("tag", {"item": 3})])
    assert not check.is_valid([call("order", {"items": [{"sku": "a", "parts": [{}]}]})])  # inner Item
    assert not check.is_valid([call("order", {"items": [], "ship_to": {}})])  # Address
    assert not check.is_valid([call("tag", {"item": "not an integer"})])  # tag's own Item


def test_references_to_the_root_follow_the_schema() -> None:
    check = validator([NOW, TREE], {"type": "function", "function": {"name": "tree"}})
    assert check.is_valid([call("tree", {"label": "a", "children": [{"label": "b", "children": []}]})])
    assert not check.is_valid([call("tree", {"label": "a", "children": [{"children": []}]})])


@pytest.mark.parametrize("ref", ["https://example.com/schema.json", "#/$defs/Missing", "other.json#/$defs/A"])
def test_unresolvable_references_are_a_400_on_the_tools_parameters(ref: str) -> None:
    bad = {
        "type": "function",
        "function": {"name": "bad", "parameters": {"properties": {"a": {"$ref": ref}}}},
    }
    with pytest.raises(InvalidParameterError) as raised:
        validator([NOW, bad])
    assert raised.value.param == "tools[1].function.parameters"


def test_only_required_and_named_constrain_the_output() -> None:
    with pytest.raises(ValueError, match="auto"):
        required_calls_schema(parse_tools([NOW]), ToolChoice("auto"))


@pytest.mark.parametrize(
    "tools", [[WEATHER, NOW], [ORDER, TAG], [NOW, TREE]], ids=["plain", "defs", "root-ref"]
)
def test_the_schemas_compile_as_grammars(tools: list[dict[str, Any]]) -> None:
    """The grammar engine resolves the rewritten references too (it errors on a missing pointer)."""
    llguidance = pytest.importorskip("llguidance")
    declarations = parse_tools(tools)
    schema = required_calls_schema(declarations, ToolChoice("required"))
    grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
