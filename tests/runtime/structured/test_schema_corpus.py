"""JSON-schema constrained output, checked by an independent validator over a corpus of schemas.

A tiny random-weight model samples at temperature 1 under each schema of the corpus (hand-written
and generated, see schema_corpus.py), three outputs a schema (two choices of an `n = 2` request
and one request of its own, all seeded), batched in one `generate` call. Each output that ended
by "stop" must parse (`json.loads`) and validate (jsonschema Draft 2020-12, formats checked);
each cut by `max_tokens` must be a prefix the grammar accepts. Most must end by "stop", or the
test would prove nothing about complete outputs. Every complete output of a generated schema
must fail its mutant (a required property's type swapped), so the validator demonstrably checks.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.structured.schema_corpus import HAND_WRITTEN, CorpusSchema, generated_schemas
from tests.runtime.structured.support import (
    engine,
    json_spec,
    output_ids,
    parse_json,
    refused_at,
    schema_errors,
)

NUM_GENERATED = 130
MAX_TOKENS = 200
# Outputs that must end by "stop" (the rest run into max_tokens, which a random model may).
MIN_STOP_FRACTION = 0.8


@dataclass
class CorpusRun:
    corpus: list[CorpusSchema]
    # (schema, finish_reason, text, token ids without a final EOS, prefix refused at)
    outputs: list[tuple[CorpusSchema, str | None, str, list[int], int | None]] = field(default_factory=list)

    @property
    def finishes(self) -> Counter[str | None]:
        return Counter(reason for _, reason, _, _, _ in self.outputs)


@pytest.fixture(scope="module")
def corpus_run(tiny_checkpoint: Callable[..., Path]) -> CorpusRun:
    corpus = HAND_WRITTEN + generated_schemas(NUM_GENERATED)
    llm = engine(tiny_checkpoint("llama"))
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    owners: list[CorpusSchema] = []
    for index, entry in enumerate(corpus):
        spec = json_spec(entry.schema)
        for n, seed in ((2, 1000 + index), (1, 5000 + index)):
            prompts.append([5 + (7 * index + n) % 370, 40, 41])
            params.append(
                SamplingParams(
                    n=n, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS, structured_outputs=spec
                )
            )
            owners.append(entry)
    results = llm.generate(prompts, params)
    run = CorpusRun(corpus)
    eos = llm.tokenizer.eos_token_ids or llm.model_config.eos_token_ids
    for entry, request, result in zip(owners, params, results, strict=True):
        assert request.structured_outputs is not None
        for choice in result.choices:
            ids = output_ids(choice, eos)
            refused = refused_at(llm, request.structured_outputs, ids)
            run.outputs.append((entry, choice.finish_reason, choice.text, ids, refused))
    llm.close()
    return run


def test_the_corpus_is_large_and_covers_the_keywords(corpus_run: CorpusRun) -> None:
    corpus = corpus_run.corpus
    assert len(corpus) >= 150
    assert len({json.dumps(entry.schema, sort_keys=True) for entry in corpus}) == len(corpus), "duplicates"
    text = [json.dumps(entry.schema) for entry in corpus]
    for keyword in (
        '"minItems"',
        '"maxItems"',
        '"enum"',
        '"const"',
        '"minimum"',
        '"maximum"',
        '"exclusiveMinimum"',
        '"exclusiveMaximum"',
        '"minLength"',
        '"maxLength"',
        '"pattern"',
        '"anyOf"',
        '"$ref"',
        '"additionalProperties": false',
        '"type": [',
        '"format": "date"',
        '"format": "uuid"',
        '"format": "email"',
    ):
        assert sum(keyword in schema for schema in text) >= 3, f"the corpus rarely uses {keyword}"
    # Properties left optional (a required subset), and patterns next to a minimum length.
    assert (
        sum(1 for e in corpus if set(e.schema.get("properties", {})) - set(e.schema.get("required", [])))
        >= 20
    )
    assert sum('"pattern"' in t and '"minLength"' in t for t in text) >= 10


def test_complete_outputs_validate_and_cut_ones_are_grammar_prefixes(corpus_run: CorpusRun) -> None:
    failures: list[str] = []
    for entry, reason, text, _ids, refused in corpus_run.outputs:
        if refused is not None:
            failures.append(f"{entry.name}: the grammar refuses token {refused} of its own output {text!r}")
        if reason == "length":
            continue
        assert reason == "stop", (entry.name, reason)
        try:
            value = parse_json(text)
        except ValueError as error:
            failures.append(f"{entry.name}: not JSON ({error}): {text!r}")
            continue
        errors = schema_errors(entry.schema, value)
        if errors:
            failures.append(f"{entry.name}: {errors[:3]} in {text!r} for {json.dumps(entry.schema)}")
    assert not failures, "\n".join(failures[:20])


def test_most_outputs_are_complete(corpus_run: CorpusRun) -> None:
    finishes = corpus_run.finishes
    total = sum(finishes.values())
    assert set(finishes) <= {"stop", "length"}
    assert total == 3 * len(corpus_run.corpus)
    assert finishes["stop"] >= MIN_STOP_FRACTION * total, finishes
    # Every schema got at least one complete output, but for a handful.
    complete = {entry.name for entry, reason, *_ in corpus_run.outputs if reason == "stop"}
    assert len(complete) >= len(corpus_run.corpus) - 5, sorted({e.name for e in corpus_run.corpus} - complete)
    print(f"\ncorpus: {len(corpus_run.corpus)} schemas, {total} outputs, {dict(finishes)}")


def test_complete_outputs_fail_their_mutant_schema(corpus_run: CorpusRun) -> None:
    """The validator is really applied: a schema that differs where the output is constrained
    (a required property of another type) rejects every complete output."""
    checked = 0
    for entry, reason, text, _, _ in corpus_run.outputs:
        if entry.mutant is None or reason != "stop":
            continue
        value: Any = parse_json(text)
        assert not schema_errors(entry.schema, value)
        assert schema_errors(entry.mutant, value), f"{entry.name}: {text!r} also satisfies the mutant"
        checked += 1
    assert checked >= 2 * NUM_GENERATED
