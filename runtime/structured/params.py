"""What a request constrains its output to: one grammar, named by its kind (vLLM's
`structured_outputs` names: json, regex, choice, grammar; plus OpenAI's `json_object`).

Torch-free and engine-free: `SamplingParams` carries it, the server and `kvasir generate` build it,
and the grammar compiler turns it into a matcher. The value is checked for shape here (a schema is
a JSON object, a choice a non-empty list of strings); whether the grammar compiles is the
compiler's business, with its own limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from kvasir.runtime.sample.params import InvalidParameterError

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar", "tool_calls"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = (
    "json",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "tool_calls",
)
# A choice list is compiled into one alternation: bound its size like any grammar's.
MAX_CHOICES = 4096


@dataclass(frozen=True)
class CallFormat:
    """How a model family writes one tool call: `trigger` starts it in free text, `begin` is the
    text from the trigger to the arguments (`{name}` stands for the JSON-quoted tool name), and
    `end` closes it. `special_trigger`: the trigger is one special token of the tokenizer."""

    trigger: str
    begin: str
    end: str
    special_trigger: bool = False


@dataclass(frozen=True)
class StructuredOutputs:
    """One grammar for a request's output.

    `value` by kind: json - the schema as canonical JSON text; json_object - "" (any JSON object);
    regex - the pattern; choice - the options as a JSON list; grammar - Lark text (GBNF, recognised
    by its `::=`, is converted to Lark); tool_calls - free text in which each tool call, once its
    trigger appears, follows its tool's schema (`tool_calls()`, for strict tools under
    `tool_choice: auto`). `param` is the request field errors name (for example
    `response_format.json_schema.schema` or `tools[2].function.parameters`).
    """

    kind: StructuredKind
    value: str
    param: str = "structured_outputs"

    @property
    def cache_key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (besides the tokenizer and the compile options)."""
        return (self.kind, self.value)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> StructuredOutputs:
        """A schema given as a JSON object (a dict, or a string holding one)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise InvalidParameterError(param, f"is not valid JSON: {error}") from None
            except RecursionError:
                raise InvalidParameterError(param, "is nested too deeply") from None
        if not isinstance(schema, dict):
            raise InvalidParameterError(param, "must be a JSON schema object")
        try:
            return cls("json", canonical_json(schema), param)
        except RecursionError:
            raise InvalidParameterError(param, "is nested too deeply") from None

    @classmethod
    def json_object(cls, param: str = "response_format") -> StructuredOutputs:
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: Any, param: str) -> StructuredOutputs:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidParameterError(param, "must be a non-empty regular expression string")
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, options: Any, param: str) -> StructuredOutputs:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise InvalidParameterError(param, "must be a non-empty list of strings")
        if len(options) > MAX_CHOICES:
            raise InvalidParameterError(param, f"at most {MAX_CHOICES} choices, got {len(options)}")
        if any(not option for option in options):
            raise InvalidParameterError(param, "choices must be non-empty strings")
        return cls("choice", json.dumps(options, ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: Any, param: str) -> StructuredOutputs:
        if not isinstance(text, str) or not text.strip():
            raise InvalidParameterError(param, "must be a non-empty grammar (Lark, or GBNF)")
        return cls("grammar", text, param)

    @classmethod
    def tool_calls(
        cls, call_format: CallFormat, tools: list[tuple[str, dict[str, Any] | None]], param: str = "tools"
    ) -> StructuredOutputs:
        """Free text with tool calls in `call_format`; a call to a tool given with a schema is
        constrained to it once the call starts, one given with None takes any JSON object."""
        value = {
            "format": {"trigger": call_format.trigger, "begin": call_format.begin, "end": call_format.end},
            "special_trigger": call_format.special_trigger,
            "tools": [{"name": name, "schema": schema} for name, schema in tools],
        }
        return cls("tool_calls", canonical_json(value), param)

    @property
    def metric_kind(self) -> str:
        """The `kind` label of the structured-output metrics."""
        return self.kind


def canonical_json(value: Any) -> str:
    """One compact spelling of a JSON value, keys in the order sent: the order of `properties`
    fixes the order the model writes them in, so two schemas that differ only in it are two
    grammars (and two cache entries)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def parse_structured_outputs(body: Any, param: str = "structured_outputs") -> StructuredOutputs:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar (and the
    `json_object: true` shorthand). Other keys vLLM defines there and this server does not
    enforce are refused, never ignored."""
    if not isinstance(body, dict):
        raise InvalidParameterError(param, "must be an object")
    given = {key: value for key, value in body.items() if value is not None and value is not False}
    unknown = sorted(set(given) - {"json", "regex", "choice", "grammar", "json_object"})
    if unknown:
        raise InvalidParameterError(f"{param}.{unknown[0]}", "is not supported by this server")
    if len(given) != 1:
        raise InvalidParameterError(param, "give exactly one of json, regex, choice, grammar or json_object")
    ((key, value),) = given.items()
    where = f"{param}.{key}"
    if key == "json":
        return StructuredOutputs.json_schema(value, where)
    if key == "json_object":
        if value is not True:
            raise InvalidParameterError(where, "must be true")
        return StructuredOutputs.json_object(where)
    if key == "regex":
        return StructuredOutputs.regex(value, where)
    if key == "choice":
        return StructuredOutputs.choice(value, where)
    return StructuredOutputs.grammar(value, where)
