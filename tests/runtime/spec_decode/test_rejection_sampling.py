"""Verifying drafts keeps the target's distribution: rejection sampling against a chi-square test."""

from __future__ import annotations

import pytest
import torch

from kvasir.runtime.sample.params import SamplingParams
from kvasir.runtime.sample.sampler import Sampler, SamplingBatch
from kvasir.runtime.spec_decode.verification import verification_rows, verify_rows
from tests.runtime.sample.test_sampler import BASE_LOGITS, CPU, assert_matches, make_request

NUM_DRAWS = 20_000


def first_tokens(params: SamplingParams, draft: int) -> tuple[torch.Tensor, float]:
    """Frequencies of the first emitted token over NUM_DRAWS seeds, and the acceptance rate."""
    requests = [make_request(params, seed=seed) for seed in range(NUM_DRAWS)]
    batch = SamplingBatch.build(requests, BASE_LOGITS.numel(), CPU)
    logits = BASE_LOGITS.expand(NUM_DRAWS, -1).clone()
    drafts = torch.full((NUM_DRAWS,), draft, dtype=torch.int64)
    output = verify_rows(logits, batch, drafts)
    assert output.accepted is not None
    tokens = torch.tensor(output.token_ids)
    accepted = torch.tensor(output.accepted)
    assert (tokens[accepted] == draft).all(), "an accepted row must emit its draft"
    assert (tokens[~accepted] != draft).all(), "a rejected row draws from the residual, without the draft"
    freq = torch.bincount(tokens, minlength=BASE_LOGITS.numel()).double() / NUM_DRAWS
    return freq, accepted.double().mean().item()


@pytest.mark.parametrize("draft", [0, 3, 6])  # the likeliest token, a middling one, a rare one
@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), torch.softmax(BASE_LOGITS, -1)),
        (SamplingParams(temperature=0.7), torch.softmax(BASE_LOGITS / 0.7, -1)),
        (
            SamplingParams(temperature=1.0, top_k=3),
            torch.softmax(BASE_LOGITS.masked_fill(BASE_LOGITS < 1.0, float("-inf")), -1),
        ),
    ],
    ids=["t1", "t0.7", "top3"],
)
def test_emitted_tokens_follow_the_target_distribution(
    params: SamplingParams, expected: torch.Tensor, draft: int
) -> None:
    freq, acceptance = first_tokens(params, draft)
    assert_matches(freq, expected, NUM_DRAWS)
    # A point-mass draft is accepted with exactly its target probability.
    assert acceptance == pytest.approx(expected[draft].item(), abs=0.015)


def test_greedy_rows_accept_only_the_argmax() -> None:
    request = make_request(SamplingParams(temperature=0.0))
    for draft, accepted in ((0, True), (1, False)):
        batch = SamplingBatch.build([request], BASE_LOGITS.numel(), CPU)
        output = verify_rows(BASE_LOGITS.unsqueeze(0).clone(), batch, torch.tensor([draft]))
        assert output.accepted == [accepted]
        assert output.token_ids == [0]  # the argmax either way


def test_rows_without_a_draft_sample_as_without_speculation() -> None:
    params = SamplingParams(temperature=0.8, seed=5)
    requests = [make_request(params, seed=seed) for seed in range(64)]
    batch = SamplingBatch.build(requests, BASE_LOGITS.numel(), CPU)
    logits = BASE_LOGITS.expand(64, -1).clone()
    plain = Sampler()(logits, batch).token_ids
    verified = verify_rows(logits, batch, torch.full((64,), -1))
    assert verified.token_ids == plain
    assert verified.accepted == [False] * 64


def test_rows_after_a_draft_see_it_in_their_history() -> None:
    """The row scoring the second draft counts the first as output: penalties and positions."""
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0, min_tokens=2)
    request = make_request(params, output=(4,))
    rows = verification_rows(request, [5, 6])
    assert [row.output_token_ids for row in rows] == [[4], [4, 5], [4, 5, 6]]
    batch = SamplingBatch.build(rows, BASE_LOGITS.numel(), CPU)
    assert batch.output_positions.tolist() == [1, 2, 3]
    # min_tokens=2: only the first row (one output so far) still suppresses EOS.
    assert batch.suppressed_token_ids is not None
    assert batch.suppressed_token_ids[:, 0].tolist() == [7, 8, 8]  # 8 = padding (vocab size)
