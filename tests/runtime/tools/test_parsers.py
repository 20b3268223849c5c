"""The tool-call parsers on scripted outputs replayed as token ids, streamed in every chunking."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.runtime.loader.tokenizer import Tokenizer
from kvasir.runtime.tools.parsers import (
    TOOL_CALL_PARSERS,
    ParsedDelta,
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    parser_for_template,
)
from tests.runtime.tools.cases import CASES, Case


def parse(parser: ToolCallParser, ids: Sequence[int], cuts: Sequence[int]) -> list[ParsedDelta]:
    """Feed `ids` split at `cuts` (sorted positions), then finish; every delta in order."""
    bounds = [0, *cuts, len(ids)]
    deltas = [parser.feed(ids[start:end]) for start, end in itertools.pairwise(bounds)]
    return [*deltas, parser.finish()]


def summary(output: ParsedOutput) -> tuple[str | None, list[tuple[str, str]]]:
    return output.content, [(call.name, call.arguments) for call in output.tool_calls]


def check_stream_matches_result(deltas: list[ParsedDelta], result: ParsedOutput) -> None:
    """The streaming invariant: joined deltas are the result, ids and names sent once, first."""
    assert "".join(d.content for d in deltas) == (result.content or "")
    pieces = [call for d in deltas for call in d.tool_calls]
    for index, call in enumerate(result.tool_calls):
        mine = [piece for piece in pieces if piece.index == index]
        assert mine and (mine[0].id, mine[0].name) == (call.id, call.name)
        assert all(piece.id is None and piece.name is None for piece in mine[1:])
        assert "".join(piece.arguments for piece in mine) == call.arguments
    assert {piece.index for piece in pieces} == set(range(len(result.tool_calls)))


def encode(tokenizer: Tokenizer, case: Case) -> list[int]:
    return tokenizer.encode(case.text, add_special_tokens=False)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_case_parses_to_its_answer(tokenizer: Tokenizer, case: Case) -> None:
    ids = encode(tokenizer, case)
    for cuts in ([], range(1, len(ids))):  # all at once, then one token at a time
        parser = TOOL_CALL_PARSERS[case.family](tokenizer)
        deltas = parse(parser, ids, list(cuts))
        result = parser.result()
        assert summary(result) == (case.content, list(case.calls))
        check_stream_matches_result(deltas, result)
        assert all(call.id.startswith("call_") and len(call.id) == 29 for call in result.tool_calls)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_streams_the_same_answer(
    special_tokenizer: Tokenizer, case: Case, data: st.DataObject
) -> None:
    ids = encode(special_tokenizer, case)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1))), label="cuts"))
    parser = TOOL_CALL_PARSERS[case.family](special_tokenizer)
    deltas = parse(parser, ids, [c for c in cuts if c < len(ids)])
    assert summary(parser.result()) == (case.content, list(case.calls))
    check_stream_matches_result(deltas, parser.result())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), data=st.data())
def test_any_chunking_streams_the_same_answer_with_text_markers(
    smollm2_tokenizer: Tokenizer, case: Case, data: st.DataObject
) -> None:
    """SmolLM2 spells every marker in several tokens, so chunks also cut through markers."""
    ids = encode(smollm2_tokenizer, case)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1))), label="cuts"))
    parser = TOOL_CALL_PARSERS[case.family](smollm2_tokenizer)
    deltas = parse(parser, ids, [c for c in cuts if c < len(ids)])
    assert summary(parser.result()) == (case.content, list(case.calls))
    check_stream_matches_result(deltas, parser.result())


def test_markers_are_tokens_in_one_tokenizer_and_text_in_the_other(
    special_tokenizer: Tokenizer, smollm2_tokenizer: Tokenizer
) -> None:
    for family, parser_class in TOOL_CALL_PARSERS.items():
        markers = parser_class.START_MARKERS + parser_class.OTHER_MARKERS
        assert not parser_class(special_tokenizer)._tokens.text_markers, family
        assert parser_class(smollm2_tokenizer)._tokens.text_markers == markers, family


def test_split_characters_never_stream_as_replacement_characters(special_tokenizer: Tokenizer) -> None:
    case = next(c for c in CASES if str(c) == "hermes-unicode")
    ids = encode(special_tokenizer, case)
    pieces = [special_tokenizer.decode([i]) for i in ids]
    assert sum("\ufffd" in piece for piece in pieces) >= 4  # else this test proves little
    parser = TOOL_CALL_PARSERS["hermes"](special_tokenizer)
    deltas = parse(parser, ids, range(1, len(ids)))
    assert not any("\ufffd" in d.content + "".join(c.arguments for c in d.tool_calls) for d in deltas)


def test_arguments_stream_as_they_are_written_and_only_after_the_name(special_tokenizer: Tokenizer) -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    ids = special_tokenizer.encode(text, add_special_tokens=False)
    parser = TOOL_CALL_PARSERS["hermes"](special_tokenizer)
    deltas = [parser.feed([token_id]) for token_id in ids]
    announced = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert '"arguments": {' in special_tokenizer.decode(ids[: announced + 1])
    assert '"arguments": {' not in special_tokenizer.decode(ids[:announced])
    assert sum(bool(d.tool_calls) for d in deltas) > 5
    assert not parser.finish().tool_calls


@pytest.mark.parametrize("family", ["hermes", "mistral"])
def test_end_of_sequence_is_skipped_unless_asked_for(special_tokenizer: Tokenizer, family: str) -> None:
    ids = special_tokenizer.encode("Hello there.<|eot_id|>", add_special_tokens=False)
    parser = TOOL_CALL_PARSERS[family](special_tokenizer)
    parse(parser, ids, [])
    assert parser.result().content == "Hello there."
    parser = TOOL_CALL_PARSERS[family](special_tokenizer, skip_special_tokens=False)
    parse(parser, ids, [])
    assert parser.result().content == "Hello there.<|eot_id|>"


def test_call_ids_are_unique(special_tokenizer: Tokenizer) -> None:
    case = next(c for c in CASES if str(c) == "hermes-parallel")
    ids = {
        call.id
        for _ in range(5)
        for call in parse_all(TOOL_CALL_PARSERS["hermes"](special_tokenizer), encode(special_tokenizer, case))
    }
    assert len(ids) == 10


def parse_all(parser: ToolCallParser, ids: list[int]) -> list[ToolCall]:
    parse(parser, ids, [])
    return parser.result().tool_calls


def test_a_parser_is_used_once(special_tokenizer: Tokenizer) -> None:
    parser = TOOL_CALL_PARSERS["hermes"](special_tokenizer)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed([1])
    with pytest.raises(RuntimeError):
        parser.finish()


@pytest.mark.parametrize(
    ("template", "family"),
    [
        (
            "{% for tool in tools %}...{% endfor %}<tool_call>\n{{ tool_call | tojson }}\n</tool_call>",
            "hermes",
        ),
        ('{{- "<|python_tag|>" + tool_call.name }}{%- if message.role == "ipython" %}', "llama3_json"),
        ('{"name": function name, "parameters": dictionary}<|eom_id|>', "llama3_json"),
        ("{%- if message.tool_calls %}[TOOL_CALLS][{{ tool_calls | tojson }}]", "mistral"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_template_picks_the_family(template: str | None, family: str) -> None:
    assert parser_for_template(template) == family


def test_smollm2s_template_gets_the_default(smollm2_tokenizer: Tokenizer) -> None:
    assert parser_for_template(smollm2_tokenizer.chat_template) == "hermes"


FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"),
    *('{"name": "f", "arguments": ', '{"name": "g", "parameters": {}}', '"name"', '"arguments"', '"f"'),
    *("{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", "<", "[TOOL", "x", "7", "é", "日本", "🎉"),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    family=st.sampled_from(sorted(TOOL_CALL_PARSERS)),
    pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    data=st.data(),
)
def test_any_output_streams_consistently(
    tokenizer: Tokenizer, family: str, pieces: list[str], data: st.DataObject
) -> None:
    """Whatever the model writes, malformed or not: chunking changes nothing, the stream adds up
    to the result, and no marker reaches the content."""
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(ids) - 1, 1))), label="cuts"))
    streamed = TOOL_CALL_PARSERS[family](tokenizer)
    deltas = parse(streamed, ids, [c for c in cuts if c < len(ids)])
    check_stream_matches_result(deltas, streamed.result())
    whole = TOOL_CALL_PARSERS[family](tokenizer)
    parse(whole, ids, [])
    assert summary(streamed.result()) == summary(whole.result())
    parser_class = TOOL_CALL_PARSERS[family]
    content = streamed.result().content or ""
    assert not any(marker in content for marker in parser_class.START_MARKERS + parser_class.OTHER_MARKERS)
