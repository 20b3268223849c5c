"""A request's grammar as llguidance's grammar text: JSON schemas (checked first), regexes,
choices and Lark (or GBNF, converted to Lark).

Raises InvalidParameterError naming the request field for anything malformed; what the engine
cannot enforce is found when the grammar is built (`compiler`), and explained by `schema_check`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from kvasir.runtime.sample.params import InvalidParameterError
from kvasir.runtime.structured.limits import GrammarLimits
from kvasir.runtime.structured.params import StructuredOutputs
from kvasir.runtime.structured.schema_check import check_pattern, check_schema
from kvasir.runtime.structured.tool_grammar import tool_calls_lark

# Any JSON object, as OpenAI's `json_object` mode promises.
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def json_options(limits: GrammarLimits) -> JsonCompileOptions:
    """llguidance's JSON options: whitespace between tokens bounded (none when the limit is 0)."""
    if limits.max_whitespace == 0:
        return {"whitespace_flexible": False, "whitespace_pattern": None}  # a schema's own pattern too
    return {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{limits.max_whitespace}}}"}


def grammar_text(spec: StructuredOutputs, limits: GrammarLimits) -> str:
    """The llguidance grammar for `spec` (not yet compiled against a tokenizer)."""
    if len(spec.value.encode()) > limits.max_spec_bytes:
        raise InvalidParameterError(
            spec.param,
            f"is {len(spec.value.encode())} bytes; at most {limits.max_spec_bytes} are compiled "
            "(--structured-outputs-max-spec-bytes)",
        )
    if spec.kind in ("json", "json_object"):
        schema = json.loads(spec.value) if spec.kind == "json" else ANY_OBJECT_SCHEMA
        return json_schema_grammar(schema, spec.param, limits)
    if spec.kind == "regex":
        check_pattern(spec.value, spec.param)
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        options = json.loads(spec.value)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    if spec.kind == "tool_calls":
        return llguidance.LLMatcher.grammar_from_lark(tool_calls_lark(spec.value, json_options(limits)))
    return llguidance.LLMatcher.grammar_from_lark(lark_text(spec.value, spec.param))


def json_schema_grammar(schema: dict[str, Any], param: str, limits: GrammarLimits) -> str:
    """A checked JSON schema as a grammar. The schema's own `x-guidance` options are replaced by
    ours, whole: a client's would otherwise widen the whitespace bound, or make the engine
    lenient (unsupported keywords ignored) or coerce an overlapping `oneOf` to `anyOf`, and a
    schema is never silently weakened."""
    check_schema(schema, param)
    schema = {**schema, "x-guidance": json_options(limits)}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as error:
        raise InvalidParameterError(param, f"is not a usable JSON schema: {error}") from None


def lark_text(text: str, param: str) -> str:
    """Lark as given; GBNF (llama.cpp's grammar syntax, recognised by `::=`) converted to Lark."""
    if "::=" not in text:
        return text
    try:
        return str(any_to_lark(text))
    except Exception as error:  # the converter raises plain Exceptions for syntax errors
        raise InvalidParameterError(param, f"is not a valid GBNF grammar: {error}") from None
