"""--speculative-config: vLLM's JSON shape, every bad field named."""

from __future__ import annotations

import pytest

from kvasir.runtime.spec_decode.config import SpeculativeConfig, parse_speculative_config


def test_ngram_bounds_follow_vllm() -> None:
    both = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert both.ngram_range == (5, 5)
    only_max = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    )
    assert only_max.ngram_range == (3, 3)
    explicit = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    )
    assert explicit.ngram_range == (2, 4)


def test_round_trip_through_json() -> None:
    config = SpeculativeConfig(method="layer_skip", num_layers=6, num_speculative_tokens=3)
    assert parse_speculative_config(config.to_json()) == config
    draft = SpeculativeConfig(method="draft_model", model="/models/small", num_speculative_tokens=4)
    assert parse_speculative_config(draft.to_json()) == draft


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("not json", "valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"num_speculative_tokens": 4}', "method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 4}', "method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
            "prompt_lookup_min",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}', "prompt_lookup_max"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "model"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "model"),
        ('{"method": "layer_skip", "num_speculative_tokens": 2}', "num_layers"),
        ('{"method": "layer_skip", "num_speculative_tokens": 2, "num_layers": 0}', "num_layers"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5}',
            "min_acceptance_rate",
        ),
    ],
)
def test_bad_configs_name_the_field(value: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        parse_speculative_config(value)
