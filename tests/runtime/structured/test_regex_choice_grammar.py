"""Regex, choice and grammar (Lark, GBNF) constrained output, checked by independent references:
Python's `re.fullmatch` for regexes (patterns whose Python and Rust-regex meanings agree: ASCII
classes, no \\d or \\w), membership for choices, the `lark` parser for the Lark grammar and a small
recursive-descent parser for the GBNF one. A tiny random model samples at temperature 1 with
several seeds, everything in one batch."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import lark
import pytest

from kvasir.runtime.engine.outputs import Completion
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.structured.params import StructuredOutputs
from tests.runtime.structured.support import engine, output_ids, refused_at

SAMPLES = 8  # per grammar: two seeded requests of n = 4
MAX_TOKENS = 48

# (pattern, bounded): a bounded language always ends before MAX_TOKENS.
REGEXES = [
    (r"[a-z]{3,8}", True),
    (r"(cat|dog|bird)s?", True),
    (r"[0-9]{3}-[0-9]{4}", True),
    (r"#[0-9a-f]{6}", True),
    (r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?", True),
    (r"(a|ab|abc)d", True),
    (r"[A-Z][a-z]{0,4}( [A-Z][a-z]{0,4}){0,2}", True),
    (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", True),
    (r"(true|false|null)", True),
    (r'[^\n"]{1,10}', True),
    (r"x*y", False),
    (r"(ab|cd)+", False),
]

CHOICES = ["yes", "no", "maybe", "yes please", "n/a", "é", 'say "hi"']

# Expressions nested at most two deep, as Lark (the reference: the `lark` package, same text).
LARK_GRAMMAR = r"""
start: sum2
sum2: prod2 (ADD prod2)?
prod2: atom2 (MUL atom2)?
atom2: NUMBER | "(" sum1 ")"
sum1: prod1 (ADD prod1)?
prod1: atom1 (MUL atom1)?
atom1: NUMBER | "(" NUMBER ")"
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[0-9]{1,3}/
"""

# S-expressions two lists deep, as GBNF (the reference: `parse_sexpr` below).
GBNF_GRAMMAR = r"""
root ::= list2
list2 ::= "(" list1 (" " item2){0,2} ")"
item2 ::= list1 | atom
list1 ::= "(" (item1 (" " item1){0,2})? ")"
item1 ::= list0 | atom
list0 ::= "(" (atom (" " atom){0,2})? ")"
atom ::= [a-z]{1,5} | [0-9]{1,3}
"""


def parse_sexpr(text: str) -> bool:
    """Whether `text` is in GBNF_GRAMMAR's language: a recursive-descent parser written from it."""

    def atom(i: int) -> int | None:
        for alphabet, most in (("abcdefghijklmnopqrstuvwxyz", 5), ("0123456789", 3)):
            j = i
            while j < len(text) and text[j] in alphabet and j - i < most:
                j += 1
            if j > i and (j == len(text) or text[j] not in alphabet):
                return j
        return None

    def items(i: int, depth: int, first_required: bool) -> int | None:
        """'(' item (' ' item){0,2} ')' where an item is an atom or a list one level down."""
        if i >= len(text) or text[i] != "(":
            return None
        i += 1
        count = 0
        while count < 3:
            if count:
                if text[i : i + 1] != " ":
                    break
                i += 1
            j = None
            if depth > 0:
                j = items(i, depth - 1, False)
            if j is None and not (first_required and count == 0):
                j = atom(i)
            if j is None:
                if count == 0 and not first_required and text[i : i + 1] == ")":
                    break
                return None
            i, count = j, count + 1
        if text[i : i + 1] != ")":
            return None
        return i + 1

    return items(0, 2, True) == len(text)


def test_the_references_reject_what_is_outside_the_language() -> None:
    """The references can fail: near misses are refused, members accepted."""
    assert parse_sexpr("(() a)") and parse_sexpr("((a 1 b) (x) 9)") and parse_sexpr("((()))")
    for bad in ("(a)", "(() abcdef)", "(()  a)", "(() a", "(() a b c)", "((((a))))", "(() 1234)", "(()a)"):
        assert not parse_sexpr(bad), bad
    parser = lark.Lark(LARK_GRAMMAR)
    parser.parse("(1+2)*3")
    for bad in ("1+", "(1", "1234", "1+2+3", "(((1)))", "1 + 2"):
        with pytest.raises(lark.exceptions.LarkError):
            parser.parse(bad)
    assert re.fullmatch(REGEXES[5][0], "abcd") and not re.fullmatch(REGEXES[5][0], "abd d")


def _specs() -> list[StructuredOutputs]:
    return [
        *(StructuredOutputs.regex(pattern, "structured_outputs.regex") for pattern, _ in REGEXES),
        StructuredOutputs.choice(CHOICES, "structured_outputs.choice"),
        StructuredOutputs.grammar(LARK_GRAMMAR, "structured_outputs.grammar"),
        StructuredOutputs.grammar(GBNF_GRAMMAR, "structured_outputs.grammar"),
    ]


@pytest.fixture(scope="module")
def outputs(tiny_checkpoint: Callable[..., Path]) -> dict[str, list[tuple[Completion, int | None]]]:
    """Per spec value: each sampled choice and where a fresh grammar state refuses it (None)."""
    llm = engine(tiny_checkpoint("llama"))
    specs = _specs()
    prompts, params = [], []
    for index, spec in enumerate(specs):
        for seed in (11 * index, 11 * index + 5):
            prompts.append([10 + index, 200 + seed % 100, 30])
            params.append(
                SamplingParams(
                    n=4, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=spec
                )
            )
    results = llm.generate(prompts, params)
    eos = llm.tokenizer.eos_token_ids or llm.model_config.eos_token_ids
    by_spec: dict[str, list[tuple[Completion, int | None]]] = {}
    for request, result in zip(params, results, strict=True):
        assert request.structured_outputs is not None
        for choice in result.choices:
            refused = refused_at(llm, request.structured_outputs, output_ids(choice, eos))
            by_spec.setdefault(request.structured_outputs.value, []).append((choice, refused))
    llm.close()
    return by_spec


@pytest.mark.parametrize(("pattern", "bounded"), REGEXES)
def test_regex_outputs_fullmatch(outputs, pattern: str, bounded: bool) -> None:
    samples = outputs[pattern]
    assert len(samples) == SAMPLES
    for choice, refused in samples:
        assert refused is None, (pattern, choice.text)
        if choice.finish_reason == "stop":
            assert re.fullmatch(pattern, choice.text), (pattern, choice.text)
        else:
            assert not bounded and choice.finish_reason == "length", (pattern, choice.text)
    complete = [choice for choice, _ in samples if choice.finish_reason == "stop"]
    assert len(complete) >= SAMPLES // 2, (pattern, [c.text for c, _ in samples])
    if pattern not in (r"(true|false|null)", r"(a|ab|abc)d"):  # tiny languages may repeat
        assert len({c.text for c in complete}) > 1, "every seed gave the same output"


def test_choice_outputs_are_exactly_one_option(outputs) -> None:
    samples = outputs[json.dumps(CHOICES, ensure_ascii=False)]
    assert len(samples) == SAMPLES
    for choice, refused in samples:
        assert refused is None and choice.finish_reason == "stop"
        assert choice.text in CHOICES, choice.text
    assert len({choice.text for choice, _ in samples}) > 1


def test_lark_grammar_outputs_parse_with_lark(outputs) -> None:
    parser = lark.Lark(LARK_GRAMMAR)
    samples = outputs[LARK_GRAMMAR]
    for choice, refused in samples:
        assert refused is None and choice.finish_reason == "stop", choice.text
        parser.parse(choice.text)
    assert len({choice.text for choice, _ in samples}) > 1


def test_gbnf_grammar_outputs_parse_with_the_reference(outputs) -> None:
    samples = outputs[GBNF_GRAMMAR]
    for choice, refused in samples:
        assert refused is None and choice.finish_reason == "stop", choice.text
        assert parse_sexpr(choice.text), choice.text
    assert len({choice.text for choice, _ in samples}) > 1
