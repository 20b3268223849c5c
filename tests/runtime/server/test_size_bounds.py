"""The bounds checked before work starts: the chat template's least tokens per message (measured on
real templates, including ones that refuse some role orders or drop empty messages), the message
count they imply, and what a non-streamed answer may hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.runtime.engine.prompt_check import ContextLengthError, PreparedRequest
from kvasir.runtime.loader.tokenizer import Tokenizer, load_tokenizer
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from kvasir.runtime.server.chat_size import check_message_count, min_tokens_per_message
from kvasir.runtime.server.held_answer import MAX_HELD_LOGPROBS, MAX_HELD_TOKENS, check_held_answer

ALTERNATING_ONLY = (  # Mistral-style: roles must alternate user/assistant, or the template raises
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
)
DROPS_EMPTY = (
    "{% for m in messages %}{% if m['content'] %}<|im_start|>{{ m['content'] }}{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Callable[..., Path]) -> Tokenizer:
    return load_tokenizer(tiny_checkpoint("llama"))


def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    copy = Tokenizer(tokenizer.backend, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    copy.chat_template = template
    return copy


def test_a_chatml_template_costs_tokens_for_every_message(tokenizer: Tokenizer) -> None:
    per_message = min_tokens_per_message(tokenizer)
    assert per_message >= 1
    # The bound never exceeds what a real message costs, whatever its role and content.
    for role in ("system", "user", "assistant", "tool"):
        one = [{"role": "user", "content": "hello there"}]
        two = [*one, {"role": role, "content": "a reply, with words"}]
        grown = len(tokenizer.encode_chat(two, add_generation_prompt=False)) - len(
            tokenizer.encode_chat(one, add_generation_prompt=False)
        )
        assert grown >= per_message, (role, grown, per_message)


def test_templates_that_refuse_orders_or_drop_messages_are_measured_safely(tokenizer: Tokenizer) -> None:
    alternating = _with_template(tokenizer, ALTERNATING_ONLY)
    assert min_tokens_per_message(alternating) >= 0  # measured on the orders it accepts, never raises
    assert min_tokens_per_message(_with_template(tokenizer, DROPS_EMPTY)) == 0  # empty messages cost nothing
    assert min_tokens_per_message(_with_template(tokenizer, "")) == 0  # no template at all


def test_too_many_messages_for_the_context_are_refused_by_count() -> None:
    check_message_count(1000, 2, 2000)
    check_message_count(10**6, 0, 2000)  # no measured cost: the count alone refuses nothing
    with pytest.raises(ContextLengthError) as refused:
        check_message_count(1001, 2, 2000)
    assert refused.value.param == "messages" and "1001 messages" in refused.value.message


def _prepared(n: int, max_tokens: int, logprobs: int | None, prompts: int = 1) -> list[PreparedRequest]:
    params = SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs)
    one = PreparedRequest("r", [1, 2], params, max_tokens, 0.0)
    return [dataclasses.replace(one, request_id=f"r{i}") for i in range(prompts)]


@pytest.mark.parametrize(
    "n, max_tokens, logprobs, prompts, param",
    [
        (64, 256, 20, 1, "logprobs"),  # the example: 344,064 logprobs held
        (1, MAX_HELD_LOGPROBS // 21 + 1, 20, 1, "logprobs"),
        (8, MAX_HELD_TOKENS // 8 + 1, None, 1, "max_tokens"),
        (2, MAX_HELD_TOKENS // 4 + 1, None, 2, "max_tokens"),  # prompts count too
        (1, MAX_HELD_LOGPROBS // 21, 20, 1, None),
        (1, MAX_HELD_TOKENS, None, 1, None),
        (1, MAX_HELD_TOKENS, 0, 1, "logprobs"),  # the sampled token's own logprob is held too
    ],
)
def test_a_non_streamed_answer_is_bounded_in_tokens_and_logprobs(
    n: int, max_tokens: int, logprobs: int | None, prompts: int, param: str | None
) -> None:
    prepared = _prepared(n, max_tokens, logprobs, prompts)
    if param is None:
        check_held_answer(prepared, max_tokens_param="max_tokens", logprobs_param="logprobs")
        return
    with pytest.raises(InvalidParameterError) as refused:
        check_held_answer(prepared, max_tokens_param="max_tokens", logprobs_param="logprobs")
    assert refused.value.param == param and "stream" in refused.value.message
