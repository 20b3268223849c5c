"""Strict tools under `tool_choice: auto`: free text, then calls constrained to a declared tool and
its schema once the family's trigger appears, with the trigger as text or as a special token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer

from kvasir.runtime.structured.compiler import CompiledGrammar, GrammarCompiler
from kvasir.runtime.tools.declarations import parse_tools
from kvasir.runtime.tools.strict_calls import strict_auto_outputs
from tests.tiny_checkpoints import EOS_ID, VOCAB_SIZE, _tokenizer_json

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = parse_tools(
    [
        {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": WEATHER}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
    ]
)


def _backend(special_markers: tuple[str, ...] = ()) -> Tokenizer:
    backend = Tokenizer.from_str(_tokenizer_json(VOCAB_SIZE))
    backend.add_special_tokens([AddedToken(marker, special=True) for marker in special_markers])
    return backend


def _grammar(family: str, backend: Tokenizer, special: bool) -> CompiledGrammar:
    spec = strict_auto_outputs(TOOLS, family, lambda _trigger: special)
    assert spec is not None
    compiler = GrammarCompiler(backend.to_str, backend.get_vocab_size(), (EOS_ID,))
    return compiler.compile(spec)


def _accepts(grammar: CompiledGrammar, backend: Tokenizer, text: str) -> bool:
    ids = backend.encode(text, add_special_tokens=False).ids
    return grammar.new_state().valid_prefix(ids) == len(ids)


CALLS = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": ', "}"),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": ', "}]"),
}


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_strict_call_must_follow_its_tool_schema_once_it_starts(family: str) -> None:
    backend = _backend()
    grammar = _grammar(family, backend, special=False)
    begin, end = CALLS[family]
    assert _accepts(grammar, backend, "The weather, then: " + begin + '{"city":"Oslo","unit":"c"}' + end)
    assert not _accepts(grammar, backend, "x " + begin + '{"city":"Oslo","unit":"kelvin"}' + end)
    assert not _accepts(grammar, backend, "x " + begin + '{"city":"Oslo"}' + end)  # unit is required
    assert _accepts(grammar, backend, "An answer in plain text, with no call at all.")


def test_a_tool_that_is_not_strict_takes_any_object_and_unknown_names_are_refused() -> None:
    backend = _backend()
    grammar = _grammar("hermes", backend, special=False)
    assert _accepts(
        grammar, backend, '<tool_call>\n{"name": "search", "arguments": {"q": [1, 2]}}\n</tool_call>'
    )
    assert not _accepts(
        grammar, backend, '<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'
    )


def test_a_special_token_trigger_is_matched_by_its_id(tmp_path: Path) -> None:
    backend = _backend(("<tool_call>",))
    grammar = _grammar("hermes", backend, special=True)
    assert _accepts(
        grammar,
        backend,
        'ok <tool_call>\n{"name": "get_weather", "arguments": {"city":"Rome","unit":"f"}}\n</tool_call>',
    )
    assert not _accepts(
        grammar,
        backend,
        'ok <tool_call>\n{"name": "get_weather", "arguments": {"city":1,"unit":"f"}}\n</tool_call>',
    )


def test_no_strict_tool_means_no_grammar() -> None:
    loose = parse_tools(
        [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    )
    assert strict_auto_outputs(loose, "hermes", lambda _trigger: False) is None
    assert strict_auto_outputs(TOOLS, "json_array", lambda _trigger: False) is None
