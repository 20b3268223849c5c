"""SamplingParams validation: every rule rejects with an error naming the field, edges are accepted."""

from __future__ import annotations

from typing import Any

import pytest

from kvasir.runtime.sample.params import MAX_LOGPROBS, InvalidParameterError, SamplingParams

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 1.0}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"stop": "END"}, "stop"),
    ({"stop": ("ok", "")}, "stop"),
    ({"stop": ("ok", 3)}, "stop"),
    ({"stop_token_ids": (1, -1)}, "stop_token_ids"),
    ({"stop_token_ids": (1.0,)}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"priority": -(2**31) - 1}, "priority"),
    ({"priority": 2**31}, "priority"),
    ({"priority": "high"}, "priority"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[str(kwargs) for kwargs, _ in INVALID])
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidParameterError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == field
    assert str(caught.value).startswith(f"{field}: ")


VALID: list[dict[str, Any]] = [
    {},
    {"n": 4, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
    {"temperature": 2, "top_p": 1e-6, "top_k": 0, "min_p": 0.0},
    {"seed": 2**63 - 1},
    {"seed": -(2**63)},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1e-3},
    {"max_tokens": None, "min_tokens": 1000},
    {"max_tokens": 1, "min_tokens": 1},
    {"stop": ("a", "bc"), "stop_token_ids": (0, 5)},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"priority": -(2**31)},
    {"priority": 2**31 - 1},
]


@pytest.mark.parametrize("kwargs", VALID)
def test_edge_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_derived_properties() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(top_k=0).effective_top_k == 0
    assert SamplingParams(top_k=7).effective_top_k == 7
