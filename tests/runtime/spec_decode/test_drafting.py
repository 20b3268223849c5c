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


def rejected_runs_before_first_pause(controller: SpeculationController, request_id: str) -> int:
    runs = 0
    while controller.wants_drafts(request_id):
        controller.observe(request_id, 4, 0)
        controller.tick()
        runs += 1
        assert runs < 100
    return runs


def test_new_requests_start_from_the_engine_wide_acceptance() -> None:
    controller = SpeculationController(min_acceptance_rate=0.2)
    # A fresh engine is optimistic: its first request pays several rejected runs.
    assert rejected_runs_before_first_pause(controller, "first") > 3
    for index in range(20):  # more requests whose drafts are all rejected
        controller.observe(f"r{index}", 4, 0)
    assert controller.engine_acceptance < 0.2
    # Now a new request pauses after one rejected run...
    assert rejected_runs_before_first_pause(controller, "late") == 1
    # ...but one whose first run is accepted keeps drafting.
    controller.observe("good", 4, 4)
    controller.tick()
    assert controller.wants_drafts("good")


def test_a_request_joining_a_poorly_drafting_engine_probes_rarely() -> None:
    controller = SpeculationController(min_acceptance_rate=0.2)
    for index in range(30):
        controller.observe(f"r{index}", 4, 0)
    runs = 0
    for _ in range(128):
        if controller.wants_drafts("late"):
            controller.observe("late", 4, 0)
            runs += 1
        controller.tick()
    assert runs <= 2  # the first run, then a probe after the longest pause
