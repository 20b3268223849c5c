"""A chat request's tools, checked: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

`parse_tools` and `parse_tool_choice` turn the request's raw JSON into frozen values, raising
`InvalidParameterError` naming the exact field (`tools[2].function.name`, `tool_choice`, ...) so the
server answers 400 with OpenAI's `param`. `required_calls_schema` is the JSON schema that constrained
decoding follows when the model must call a tool (`tool_choice` "required" or a named function).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from kvasir.runtime.sample.params import InvalidParameterError

# OpenAI's limits: a function name is 1-64 of [a-zA-Z0-9_-], and a request has at most 128 tools;
# we allow more tools (vLLM has no cap) but bound them, since every tool is rendered into the prompt
# and compiled into the grammar of `required` mode.
TOOL_NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 512

ToolChoiceMode = Literal["none", "auto", "required", "named"]


def _empty_object_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolDeclaration:
    """One function tool. `parameters` is its arguments' JSON schema (a private copy of the request's:
    treat it as read-only); `strict` is recorded as given (OpenAI's structured-outputs flag)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=_empty_object_schema)
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request JSON, the shape chat templates expect in `tools`."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        if self.strict:
            function["strict"] = True
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """How the model may call tools. `name` is set exactly when `mode` is "named"; `parallel` is
    `parallel_tool_calls` (whether one answer may hold several calls)."""

    mode: ToolChoiceMode
    name: str | None = None
    parallel: bool = True


def parse_tools(tools: Any) -> list[ToolDeclaration]:
    """The request's `tools` (None or a list of `{"type": "function", "function": {...}}`), checked.

    An empty list means no tools (OpenAI refuses it; clients send it, and nothing is ambiguous).
    Each parameters schema must itself be a valid JSON schema (Draft 2020-12), so that a bad one is
    a 400 naming it here rather than a grammar compile error later.
    """
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise InvalidParameterError("tools", "must be a list of tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidParameterError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    declarations: list[ToolDeclaration] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        declaration = _parse_tool(tool, f"tools[{i}]")
        if declaration.name in seen:
            raise InvalidParameterError(
                f"tools[{i}].function.name", f"duplicate function name {declaration.name!r}"
            )
        seen.add(declaration.name)
        declarations.append(declaration)
    return declarations


def _parse_tool(tool: Any, where: str) -> ToolDeclaration:
    if not isinstance(tool, dict):
        raise InvalidParameterError(where, 'must be an object {"type": "function", "function": {...}}')
    if tool.get("type") != "function":
        raise InvalidParameterError(f"{where}.type", f"must be 'function', got {tool.get('type')!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidParameterError(f"{where}.function", "must be an object with at least a name")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.match(name):
        raise InvalidParameterError(
            f"{where}.function.name",
            f"must be 1 to 64 characters of a-z, A-Z, 0-9, underscores and dashes, got {name!r}",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidParameterError(f"{where}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _empty_object_schema()
    elif not isinstance(parameters, dict):
        raise InvalidParameterError(f"{where}.function.parameters", "must be a JSON schema object")
    else:
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as error:
            raise InvalidParameterError(
                f"{where}.function.parameters", f"is not a valid JSON schema: {error.message}"
            ) from None
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameterError(f"{where}.function.strict", "must be a boolean")
    return ToolDeclaration(name, description, copy.deepcopy(parameters), bool(strict))


def parse_tool_choice(
    tool_choice: Any, tools: list[ToolDeclaration], parallel_tool_calls: bool | None
) -> ToolChoice:
    """The request's `tool_choice` resolved against its tools.

    Omitted, it is "auto" when there are tools and "none" otherwise (OpenAI's defaults); "auto"
    with no tools is "none" (there is nothing to call). "required" and a named function need tools,
    and the named function must be one of them. Every error names `tool_choice`, except a
    non-boolean `parallel_tool_calls`.
    """
    if parallel_tool_calls is None:
        parallel = True
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls
    else:
        raise InvalidParameterError("parallel_tool_calls", "must be a boolean")
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if isinstance(tool_choice, str):
        if tool_choice == "none" or (tool_choice == "auto" and not tools):
            return ToolChoice("none", parallel=parallel)
        if tool_choice == "auto":
            return ToolChoice("auto", parallel=parallel)
        if tool_choice == "required":
            if not tools:
                raise InvalidParameterError("tool_choice", "'required' needs at least one tool in `tools`")
            return ToolChoice("required", parallel=parallel)
        raise InvalidParameterError(
            "tool_choice",
            f"must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
        )
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise InvalidParameterError(
            "tool_choice",
            'must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
        )
    name = function.get("name")
    if not isinstance(name, str):
        raise InvalidParameterError("tool_choice", "the named function needs a string `name`")
    if not tools:
        raise InvalidParameterError("tool_choice", f"names function {name!r}, but `tools` is empty")
    if all(tool.name != name for tool in tools):
        raise InvalidParameterError("tool_choice", f"names function {name!r}, which is not in `tools`")
    return ToolChoice("named", name=name, parallel=parallel)


def required_calls_schema(tools: list[ToolDeclaration], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema of the output when the model must call: a JSON array of 1 (or, with
    parallel calls, 1 or more) `{"name": NAME, "arguments": {...}}` objects whose arguments follow
    that tool's parameters schema; only the named tool when `choice` names one.

    `name` comes before `arguments` in `properties` so that a grammar generating in that order lets
    the `json_array` parser stream arguments as soon as they start. A tool schema's root
    `$defs`/`definitions` are hoisted to the root `$defs` as `"<tool name>.<definition>"` (tool names
    have no dot, so keys never collide) and its local `$ref`s are rewritten: to the hoisted
    definitions, or to the schema's new place in the array. A root `$id`/`$schema` is dropped (it
    would change how the rewritten references resolve); a reference to another document is refused
    with a 400 naming `tools[i].function.parameters`. `tools` must be the list `parse_tools` returned
    (error names use its indices). Raises ValueError when `choice` is neither required nor named.
    """
    if choice.mode not in ("required", "named"):
        raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output to calls")
    variants: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        if choice.mode == "named" and tool.name != choice.name:
            continue
        where = f"/items/anyOf/{len(variants)}/properties/arguments"
        arguments = _embed_parameters(tool, f"tools[{i}].function.parameters", where, defs)
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    if not variants:
        raise ValueError(f"tool_choice names {choice.name!r}, which is not among the tools")
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not choice.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _embed_parameters(tool: ToolDeclaration, param: str, where: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A copy of `tool.parameters` fit to sit at JSON pointer `where` of the calls schema, its root
    definitions moved into `defs` (the calls schema's root `$defs`)."""
    schema = copy.deepcopy(tool.parameters)
    schema.pop("$id", None)
    schema.pop("$schema", None)
    hoisted: dict[str, str] = {}  # "/$defs/X" or "/definitions/X" (escaped) -> the new pointer
    moved: dict[str, Any] = {}
    for keyword in ("$defs", "definitions"):
        table = schema.pop(keyword, None)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise InvalidParameterError(param, f"`{keyword}` must be an object of schemas")
        for def_name, definition in table.items():
            key = f"{tool.name}.{def_name}"
            if key in moved:
                raise InvalidParameterError(param, f"defines {def_name!r} in both `$defs` and `definitions`")
            moved[key] = definition
            hoisted[f"/{keyword}/{_escape(def_name)}"] = f"/$defs/{_escape(key)}"
    rewritten = _rewrite_refs(schema, param, where, hoisted)
    for key, definition in moved.items():
        defs[key] = _rewrite_refs(definition, param, where, hoisted)
    return rewritten


# Keywords whose value is a map from names (any text, "$ref" included) to schemas, and keywords whose
# value is instance data: a "$ref" key inside data is not a reference.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rewrite_refs(node: Any, param: str, where: str, hoisted: dict[str, str]) -> Any:
    """`node` with every `$ref` retargeted (see `required_calls_schema`); rewrites in place."""
    if isinstance(node, list):
        return [_rewrite_refs(item, param, where, hoisted) for item in node]
    if not isinstance(node, dict):
        return node
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            node[key] = _retarget(value, param, where, hoisted)
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names are data, values schemas
            node[key] = {name: _rewrite_refs(sub, param, where, hoisted) for name, sub in value.items()}
        elif key not in _DATA_KEYWORDS:
            node[key] = _rewrite_refs(value, param, where, hoisted)
    return node


def _retarget(ref: str, param: str, where: str, hoisted: dict[str, str]) -> str:
    if not ref.startswith("#"):
        raise InvalidParameterError(
            param, f"$ref {ref!r} points outside the schema; only local '#...' references work"
        )
    pointer = ref[1:]
    if pointer and not pointer.startswith("/"):
        return ref  # a plain-name fragment ($anchor): names are document-wide, it still resolves
    for old, new in hoisted.items():
        if pointer == old or pointer.startswith(old + "/"):
            return "#" + new + pointer[len(old) :]
    if pointer.startswith(("/$defs/", "/definitions/")):
        raise InvalidParameterError(param, f"$ref {ref!r} names a definition the schema does not have")
    return "#" + where + pointer


def _escape(token: str) -> str:
    """A JSON pointer reference token (RFC 6901)."""
    return token.replace("~", "~0").replace("/", "~1")
