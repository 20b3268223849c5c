"""Constrained output is bounded and honest: whitespace between JSON tokens is bounded by
`structured_outputs_max_whitespace` (exactly, even for a model whose favourite token is a space)
and absent at 0; an output cut by max_tokens is the start of the complete one and a prefix the
grammar accepts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.structured.params import StructuredOutputs
from tests.runtime.structured.support import (
    engine,
    json_spec,
    output_errors,
    parse_json,
    refused_at,
    whitespace_runs,
)

# Bounded strings: with spaces favoured, a string is filled with spaces up to its maxLength.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "v": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            },
            "required": ["ok", "v"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "n", "tags", "inner"],
    "additionalProperties": False,
}
# Few enough gaps that 8 spaces in each still fit in max_tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "n": {"type": "integer", "minimum": 0, "maximum": 50},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}
SPACE_BONUS = 100.0


def favour_spaces(llm: LLMEngine) -> int:
    """Make the space token the model's favourite by far (a large bonus on its logit); returns its id."""
    space = llm.tokenizer.backend.token_to_id("Ġ")  # byte-level BPE's space
    assert space is not None and llm.tokenizer.decode([space]) == " "
    model = llm.runner.model
    compute_logits = model.compute_logits

    def with_bonus(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden).clone()
        logits[:, space] += SPACE_BONUS
        return logits

    model.compute_logits = with_bonus  # type: ignore[method-assign]
    return space


@pytest.fixture(scope="module")
def path(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


def _params(spec: StructuredOutputs) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec),
        SamplingParams(temperature=1.0, seed=4, n=3, max_tokens=200, structured_outputs=spec),
    ]


@pytest.mark.parametrize("max_whitespace", [8, 3, 0])
def test_whitespace_is_bounded_for_a_model_that_loves_spaces(path: Path, max_whitespace: int) -> None:
    llm = engine(path, structured_outputs_max_whitespace=max_whitespace)
    space = favour_spaces(llm)
    (free,) = llm.generate([[10, 11, 12]], SamplingParams(temperature=1.0, seed=1, max_tokens=12))
    assert free.choices[0].token_ids == [space] * 12, "the bonus does not make spaces the favourite"
    spec = json_spec(SCHEMA if max_whitespace < 8 else SMALL_SCHEMA)
    params = _params(spec)
    results = llm.generate([[10, 11, 12], [13, 14]], params)
    runs: list[str] = []
    for result in results:
        for choice in result.choices:
            assert choice.finish_reason == "stop", choice.text
            assert not output_errors(llm, spec, choice), (choice.text, output_errors(llm, spec, choice))
            value = parse_json(choice.text)
            runs += whitespace_runs(choice.text)
            # Spaces won inside strings too: they are filled to their maxLength.
            assert len(value["name"]) == 5 and value["name"].endswith("    "), choice.text
    if max_whitespace == 0:
        assert runs == []
    else:
        # The model writes a space wherever one is allowed: every run reaches the bound, none passes it.
        assert runs and max(len(run) for run in runs) == max_whitespace
        assert all(set(run) == {" "} for run in runs)


def test_json_object_mode_whitespace_is_bounded_too(path: Path) -> None:
    llm = engine(path, structured_outputs_max_whitespace=2)
    favour_spaces(llm)
    spec = StructuredOutputs.json_object()
    (result,) = llm.generate(
        [[20, 21]], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
    )
    (choice,) = result.choices
    assert choice.finish_reason == "stop" and not output_errors(llm, spec, choice)
    assert choice.text == "{  }"


@pytest.mark.parametrize(
    "spec",
    [
        json_spec(SMALL_SCHEMA),
        StructuredOutputs.regex(r"[a-z]{10,20}( [0-9]{2,4}){3}", "structured_outputs.regex"),
        StructuredOutputs.choice(
            ["the quick brown fox jumps over the lazy dog"], "structured_outputs.choice"
        ),
    ],
    ids=["json", "regex", "choice"],
)
def test_an_output_cut_by_max_tokens_is_an_accepted_prefix(path: Path, spec: StructuredOutputs) -> None:
    llm = engine(path)
    prompt = [30, 31, 32]
    (full,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec))
    complete = full.choices[0]
    assert complete.finish_reason == "stop" and not output_errors(llm, spec, complete)
    assert len(complete.token_ids) > 4
    for cut in (1, 2, len(complete.token_ids) // 2, len(complete.token_ids) - 1):
        (result,) = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=cut, structured_outputs=spec)
        )
        (choice,) = result.choices
        assert choice.finish_reason == "length"
        assert choice.token_ids == complete.token_ids[:cut]
        assert complete.text.startswith(choice.text)
        assert refused_at(llm, spec, choice.token_ids) is None
    # The prefix check can fail: the output with a token the grammar never allows (BOS) is refused.
    broken = list(complete.token_ids)
    broken[2] = llm.tokenizer.backend.token_to_id("<s>")
    assert refused_at(llm, spec, broken) == 2


@pytest.mark.parametrize(
    ("max_whitespace", "options"),
    [
        (3, {"whitespace_pattern": "[ ]{0,50}"}),
        (0, {"whitespace_flexible": True}),
        (0, {"whitespace_pattern": " *"}),
    ],
    ids=["pattern-3", "flexible-0", "pattern-0"],
)
def test_a_schema_cannot_widen_the_whitespace_bound(path: Path, max_whitespace: int, options) -> None:
    """llguidance reads whitespace options from the schema's `x-guidance`: the engine's bound wins."""
    llm = engine(path, structured_outputs_max_whitespace=max_whitespace)
    favour_spaces(llm)
    spec = json_spec({**SMALL_SCHEMA, "x-guidance": options})
    (result,) = llm.generate(
        [[40, 41]], SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec)
    )
    (choice,) = result.choices
    assert choice.finish_reason == "stop" and not output_errors(llm, spec, choice), choice.text
    runs = whitespace_runs(choice.text)
    assert max((len(run) for run in runs), default=0) == max_whitespace
