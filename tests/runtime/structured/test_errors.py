"""What cannot be enforced is refused, never weakened: `InvalidParameterError` naming the request
field, and for a schema keyword the engine cannot enforce, the keyword and its JSON pointer.
Limits name their flag. Compiles are cached, refusals and compiles past the deadline included.
No assertion here depends on how long anything takes."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.structured.params import StructuredOutputs, parse_structured_outputs
from tests.runtime.structured.support import engine, output_errors

SCHEMA_PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(path: Path) -> LLMEngine:
    return engine(path)


def refusal(llm: LLMEngine, spec: StructuredOutputs) -> InvalidParameterError:
    """The error preparing a request with `spec` raises; nothing is queued."""
    with pytest.raises(InvalidParameterError) as caught:
        llm.prepare_request("r", None, SamplingParams(structured_outputs=spec), prompt_token_ids=[5, 6, 7])
    assert not llm.has_unfinished()
    return caught.value


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


# schema -> what the message must say (the pointer and keyword, or the problem)
BAD_SCHEMAS: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("misspelt-type", {"type": "strin"}, ("not a valid JSON schema", "/type")),
    ("nested-misspelt-type", _object(a=_object(b={"type": "integr"})), ("/properties/a/properties/b/type",)),
    ("minimum-not-number", {"type": "integer", "minimum": "a"}, ("not a valid JSON schema", "/minimum")),
    ("required-not-list", {"type": "object", "required": "a"}, ("/required",)),
    ("unresolvable-ref", {"$ref": "#/$defs/missing"}, ("does not resolve", "#/$defs/missing")),
    (
        "unresolvable-nested-ref",
        _object(a={"$ref": "#/$defs/nothing"}),
        ("$ref at /properties/a does not resolve", "#/$defs/nothing"),
    ),
    (
        "unique-items",
        _object(tags={"type": "array", "uniqueItems": True}),
        ("'uniqueItems'", "/properties/tags"),
    ),
    (
        "overlapping-one-of",
        _object(x={"oneOf": [{"type": "integer"}, {"type": "number"}]}),
        ("'oneOf'", "/properties/x"),
    ),
    ("not", _object(a={"not": {"type": "string"}}), ("'not'", "/properties/a")),
    (
        "if-then",
        {"type": "array", "items": {"if": {"type": "string"}, "then": {"minLength": 2}}},
        ("'if'", "/items"),
    ),
    (
        "contains",
        _object(list={"type": "array", "contains": {"const": 1}}),
        ("'contains'", "/properties/list"),
    ),
    ("property-names", {"type": "object", "propertyNames": {"pattern": "^a"}}, ("'propertyNames'", "at /")),
    ("dependencies", {"type": "object", "dependencies": {"a": ["b"]}}, ("'dependencies'", "at /")),
    ("dynamic-ref", _object(a={"$dynamicRef": "#node"}), ("'$dynamicRef'", "/properties/a")),
    (
        "unenforced-format",
        _object(link={"type": "string", "format": "iri"}),
        ("'format'", "/properties/link", "iri"),
    ),
]


@pytest.mark.parametrize(
    ("schema", "says"), [case[1:] for case in BAD_SCHEMAS], ids=[c[0] for c in BAD_SCHEMAS]
)
def test_bad_schemas_are_refused_with_the_param_pointer_and_keyword(llm, schema, says) -> None:
    error = refusal(llm, StructuredOutputs.json_schema(schema, SCHEMA_PARAM))
    assert error.param == SCHEMA_PARAM
    for text in says:
        assert text in error.message, (text, error.message)


def test_a_schema_that_is_not_an_object_is_refused() -> None:
    for value in ("[1, 2]", "{not json", 3, ["a"]):
        with pytest.raises(InvalidParameterError) as caught:
            StructuredOutputs.json_schema(value, SCHEMA_PARAM)
        assert caught.value.param == SCHEMA_PARAM


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutputs.regex("a(b", "structured_outputs.regex"), "not a valid regular expression"),
        (StructuredOutputs.regex("[z-a]", "structured_outputs.regex"), "not a valid regular expression"),
        (
            StructuredOutputs.grammar("start: foo\nfoo: 'a' bar", "structured_outputs.grammar"),
            "not a valid grammar",
        ),
        (
            StructuredOutputs.grammar("start: undefined_rule", "structured_outputs.grammar"),
            "not a valid grammar",
        ),
        (StructuredOutputs.grammar('root ::= "a" (', "structured_outputs.grammar"), "GBNF"),
    ],
    ids=["unclosed-group", "bad-range", "lark-lexer", "lark-undefined", "gbnf"],
)
def test_bad_regexes_and_grammars_are_refused(llm, spec: StructuredOutputs, says: str) -> None:
    error = refusal(llm, spec)
    assert error.param == spec.param and says in error.message, error


def test_structured_outputs_object_is_checked_for_shape() -> None:
    cases = [
        ({"json": {}, "regex": "a"}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", ""]}, "structured_outputs.choice"),
        ({"choice": ["a", 1]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"grammar": "  "}, "structured_outputs.grammar"),
        ({"json": [1]}, "structured_outputs.json"),
    ]
    for body, param in cases:
        with pytest.raises(InvalidParameterError) as caught:
            parse_structured_outputs(body)
        assert caught.value.param == param, body
    assert parse_structured_outputs({"json": {"type": "string"}, "regex": None}).kind == "json"


def test_specs_over_the_size_limit_are_refused_naming_the_flag(path: Path) -> None:
    small = engine(path, structured_outputs_max_spec_bytes=200)
    big_schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20)}}
    assert len(json.dumps(big_schema)) > 200
    for spec in (
        StructuredOutputs.json_schema(big_schema, SCHEMA_PARAM),
        StructuredOutputs.regex(
            "(" + "|".join(f"word{i}" for i in range(40)) + ")", "structured_outputs.regex"
        ),
        StructuredOutputs.choice([f"option {i}" for i in range(30)], "structured_outputs.choice"),
        StructuredOutputs.grammar(
            "start: " + " | ".join(f'"w{i}"' for i in range(40)), "structured_outputs.grammar"
        ),
    ):
        error = refusal(small, spec)
        assert error.param == spec.param
        assert "--structured-outputs-max-spec-bytes" in error.message and "200" in error.message
    # Just under the limit compiles.
    small.prepare_request(
        "ok",
        None,
        SamplingParams(structured_outputs=StructuredOutputs.regex("[a-z]{3}", "r")),
        prompt_token_ids=[5],
    )


def test_grammars_over_the_size_limit_are_refused(path: Path) -> None:
    small = engine(path, structured_outputs_max_grammar_size=100)
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "maxLength": i} for i in range(30)},
    }
    error = refusal(small, StructuredOutputs.json_schema(schema, SCHEMA_PARAM))
    assert error.param == SCHEMA_PARAM and "grammar size" in error.message


def deep_schema(depth: int) -> dict[str, Any]:
    """A schema whose grammar doubles with each level (the subschema is inlined twice): depth 9
    takes over half a second to compile on this machine's CPUs; any deadline well under that is missed."""
    schema: dict[str, Any] = {"type": "integer"}
    for level in range(depth):
        schema = {
            "type": "object",
            "properties": {
                f"a{level}": schema,
                f"b{level}": {"type": "array", "items": schema, "maxItems": 3},
            },
            "required": [f"a{level}"],
        }
    return schema


def test_a_compile_past_its_deadline_is_refused_then_answered_from_the_cache(path: Path) -> None:
    llm = engine(path, structured_outputs_compile_timeout=0.01)
    spec = StructuredOutputs.json_schema(deep_schema(9), SCHEMA_PARAM)
    first = refusal(llm, spec)
    assert first.param == SCHEMA_PARAM
    assert "--structured-outputs-compile-timeout" in first.message and "0.01" in first.message
    # The compile goes on in the background; identical requests share it. Each retry is either
    # the same refusal (still compiling) or the cached grammar. (The loop's bound only keeps a
    # broken engine from hanging the test; nothing is asserted about time.)
    prepared = None
    for _ in range(2400):
        try:
            prepared = llm.prepare_request(
                "retry",
                None,
                SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec),
                prompt_token_ids=[5, 6],
            )
            break
        except InvalidParameterError as error:
            assert (error.param, error.message) == (first.param, first.message)
            time.sleep(0.05)
    assert prepared is not None and prepared.grammar is not None, "the background compile never finished"
    before = llm.grammars.stats.snapshot().requests
    assert before[("json", "deadline")] >= 1 and ("json", "invalid") not in before
    # Done now: the same schema again is served from the cache.
    llm.prepare_request("again", None, SamplingParams(structured_outputs=spec), prompt_token_ids=[5, 6])
    after = llm.grammars.stats.snapshot().requests
    assert after[("json", "cached")] == before.get(("json", "cached"), 0) + 1
    assert after.get(("json", "compiled")) == before.get(("json", "compiled"))
    # The grammar it compiled works.
    (result,) = llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec))
    assert not output_errors(llm, spec, result.choices[0])


def test_a_grammar_compiles_once_and_is_cached(path: Path) -> None:
    llm = engine(path)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
        "required": ["a"],
    }

    def prepare(spec: StructuredOutputs, n: int = 1) -> None:
        llm.prepare_request("r", None, SamplingParams(n=n, structured_outputs=spec), prompt_token_ids=[5])

    def counts() -> dict[tuple[str, str], int]:
        return llm.grammars.stats.snapshot().requests

    prepare(StructuredOutputs.json_schema(schema, SCHEMA_PARAM), n=3)
    assert counts() == {("json", "compiled"): 1}
    # The same schema: sent as text, from another field, is the same grammar.
    prepare(StructuredOutputs.json_schema(json.dumps(schema), "tools[0].function.parameters"))
    assert counts() == {("json", "compiled"): 1, ("json", "cached"): 1}
    assert llm.grammars.stats.snapshot().compile_seconds.count == 1
    # Properties in another order are another grammar (the order fixes the output's).
    swapped = {**schema, "properties": {"b": {"type": "null"}, "a": {"type": "integer"}}}
    prepare(StructuredOutputs.json_schema(swapped, SCHEMA_PARAM))
    assert counts() == {("json", "compiled"): 2, ("json", "cached"): 1}
    regex = StructuredOutputs.regex("[a-z]+", "structured_outputs.regex")
    prepare(regex)
    prepare(regex)
    assert counts()[("regex", "compiled")] == 1 and counts()[("regex", "cached")] == 1


def test_a_cached_refusal_names_the_field_of_each_request(llm) -> None:
    schema = _object(tags={"type": "array", "uniqueItems": True})
    first = refusal(llm, StructuredOutputs.json_schema(schema, "response_format.json_schema.schema"))
    second = refusal(llm, StructuredOutputs.json_schema(schema, "tools[3].function.parameters"))
    assert first.param == "response_format.json_schema.schema"
    assert second.param == "tools[3].function.parameters"
    assert first.message == second.message


@pytest.mark.parametrize("pattern", ["ab\\", "\\"], ids=["after-text", "alone"])
def test_a_regex_ending_in_a_lone_backslash_is_refused(llm, pattern: str) -> None:
    """Python's re and Rust's regex both refuse it (an incomplete escape); llguidance's
    grammar_from_regex drops it ('ab\\' enforced as 'ab'), so Kvasir refuses it first."""
    with pytest.raises(re.error):
        re.compile(pattern)
    error = refusal(llm, StructuredOutputs.regex(pattern, "structured_outputs.regex"))
    assert error.param == "structured_outputs.regex"


def test_requests_sharing_one_compile_count_one_compile(path: Path) -> None:
    """Two identical requests while the first one's compile runs: one compile, counted once."""
    llm = engine(path)
    compiler = llm.grammars
    release, both_asked = threading.Event(), threading.Event()
    builds, asked = [], []
    build, future = compiler._build, compiler._future

    def slow_build(spec: StructuredOutputs) -> Any:
        builds.append(spec)
        release.wait(60)
        return build(spec)

    def counted_future(spec: StructuredOutputs) -> Any:
        result = future(spec)
        asked.append(spec)
        if len(asked) == 2:
            both_asked.set()
        return result

    compiler._build = slow_build  # type: ignore[method-assign]
    compiler._future = counted_future  # type: ignore[method-assign]
    spec = StructuredOutputs.json_schema({"type": "array", "items": {"type": "integer"}}, SCHEMA_PARAM)
    with ThreadPoolExecutor(2) as pool:
        results = [pool.submit(compiler.compile, spec) for _ in range(2)]
        assert both_asked.wait(60)
        release.set()
        assert results[0].result(60).prototype is not None and results[1].result(60) is not None
    assert len(builds) == 1  # one compile, shared
    stats = compiler.stats.snapshot()
    assert stats.requests == {("json", "compiled"): 1, ("json", "cached"): 1}
    assert stats.compile_seconds.count == 1


def test_a_schemas_own_engine_options_cannot_weaken_it(llm) -> None:
    """`x-guidance` options in a client's schema (lenient: ignore unsupported keywords;
    coerce_one_of: overlapping oneOf as anyOf) are replaced by the server's, so the refusal stands."""
    lenient = {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True}
    coerced = {"x-guidance": {"coerce_one_of": True}, "oneOf": [{"type": "number"}, {"type": "integer"}]}
    for schema, keyword in ((lenient, "uniqueItems"), (coerced, "oneOf")):
        error = refusal(llm, StructuredOutputs.json_schema(schema, SCHEMA_PARAM))
        assert f"'{keyword}'" in error.message


def test_a_pattern_the_python_re_module_lacks_is_still_enforced(llm) -> None:
    """Patterns are the grammar engine's (Rust) regexes: `\\p{L}` is valid there."""
    spec = StructuredOutputs.json_schema({"type": "string", "pattern": "^\\p{L}+$"}, SCHEMA_PARAM)
    state = llm.grammars.compile(spec).new_state()
    assert state.valid_prefix(llm.tokenizer.encode('"abc"', add_special_tokens=False)) > 0


def test_a_tokenizer_the_grammar_engine_cannot_read_leaves_the_model_serving() -> None:
    """The compiler is prepared at start-up; a tokenizer llguidance refuses makes each grammar
    request a 400 saying why, not a failed start."""
    from kvasir.runtime.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler(lambda: "not a tokenizer", 100, (0,))
    compiler.prepare()  # logs, does not raise
    with pytest.raises(InvalidParameterError, match="cannot read this model's tokenizer") as caught:
        compiler.compile(StructuredOutputs.regex("a+", "structured_outputs.regex"))
    assert caught.value.param == "structured_outputs.regex"


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread nice values are a Linux feature")
def test_grammars_compile_at_a_lower_cpu_priority_than_the_engine() -> None:
    """A pathological compile must not take the decode steps' CPU: its threads run niced."""
    from kvasir.runtime.structured.compiler import COMPILE_NICENESS, GrammarCompiler

    compiler = GrammarCompiler(lambda: "unused", 10, (0,))
    niceness = compiler._pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert (
        niceness.result(60) >= os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICENESS
        or niceness.result() == 19
    )
    compiler.close()
