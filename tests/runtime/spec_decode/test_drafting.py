"""The torch-free drafting parts: prompt lookup and the controller that turns speculation down."""

from __future__ import annotations

import pytest

from kvasir.runtime.spec_decode.controller import SpeculationController
from kvasir.runtime.spec_decode.ngram import NgramProposer


def test_prompt_lookup_continues_the_most_recent_match_of_the_longest_suffix() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # The suffix (1, 2, 3) occurred at 0 and 5; the later one continues with 7, 8.
    assert proposer.propose(tokens, 2) == [7, 8]
    assert proposer.propose(tokens, 10) == [7, 8, 1, 2, 3]
    assert proposer.propose(tokens, 0) == []


def test_prompt_lookup_falls_back_to_shorter_ngrams_and_then_to_nothing() -> None:
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose([5, 6, 1, 2, 4, 5, 6], 3) == [1, 2, 4]  # only the bigram (5, 6) recurs
    assert proposer.propose([1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert proposer.propose([1, 1], 3) == []  # too short for a bigram with a continuation
    with pytest.raises(ValueError):
        NgramProposer(min_n=3, max_n=2)


def test_speculation_pauses_on_low_acceptance_and_probes_again() -> None:
    controller = SpeculationController(min_acceptance_rate=0.3)
    assert controller.wants_drafts("a")
    for _ in range(10):  # rejected run after rejected run
        if controller.wants_drafts("a"):
            controller.observe("a", 4, 0)
        controller.tick()
    paused_steps = 0
    for _ in range(200):
        paused_steps += not controller.wants_drafts("a")
        if controller.wants_drafts("a"):
            controller.observe("a", 4, 0)
        controller.tick()
    assert paused_steps > 150  # mostly paused, with probes
    # A good probe resumes drafting at once.
    while not controller.wants_drafts("a"):
        controller.tick()
    controller.observe("a", 4, 4)
    controller.tick()
    assert controller.wants_drafts("a")
    controller.forget(["a"])
    assert controller.wants_drafts("a")


def test_good_acceptance_never_pauses() -> None:
    controller = SpeculationController(min_acceptance_rate=0.3)
    for _ in range(100):
        assert controller.wants_drafts("b")
        controller.observe("b", 4, 2)
        controller.tick()
