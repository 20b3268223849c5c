"""Constrained decoding with the embedded real model (SmolLM2-135M-Instruct, a 49k-token
vocabulary whose tokens merge quotes, commas, spaces and words): JSON, regex and choice outputs,
greedy and sampled, complete and valid by the independent references. One test: loading and
running the real model is the slowest thing in this folder."""

from __future__ import annotations

from kvasir.runtime.loader.embedded import embedded_model_path
from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.structured.params import StructuredOutputs
from tests.runtime.structured.support import engine, json_spec, output_errors, parse_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}


def test_the_real_model_writes_valid_constrained_output() -> None:
    llm = engine(embedded_model_path(), max_model_len=512)
    prompt = llm.tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": "Describe a person who lives in Paris as JSON: name, age, city, languages.",
            }
        ],
        add_generation_prompt=True,
    )
    specs = [
        json_spec(SCHEMA),
        StructuredOutputs.regex(r"(Paris|London|Berlin), [A-Z][a-z]{2,10}", "structured_outputs.regex"),
        StructuredOutputs.choice(["Paris", "London", "Berlin", "Rome"], "structured_outputs.choice"),
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=specs[0]),
        SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=80, structured_outputs=specs[0]),
        SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=specs[1]),
        SamplingParams(temperature=1.0, seed=2, n=2, max_tokens=20, structured_outputs=specs[2]),
    ]
    results = llm.generate([prompt] * len(params), params)
    for request, result in zip(params, results, strict=True):
        assert request.structured_outputs is not None
        for choice in result.choices:
            assert choice.finish_reason == "stop", choice.text
            assert not output_errors(llm, request.structured_outputs, choice), (
                choice.text,
                output_errors(llm, request.structured_outputs, choice),
            )
    assert set(parse_json(results[0].choices[0].text)) == set(SCHEMA["properties"])
    llm.close()
