"""The engine's entry into speculative decoding, on plain objects: it counts each verified run the
scheduler applied (and not one aborted while its step ran), drafts for the requests that got a
token and have room, and reads requests, block tables and the runner only through its protocols."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvasir.runtime.outputs import StepResult
from kvasir.runtime.spec_decode.config import SpeculativeConfig
from kvasir.runtime.spec_decode.proposer import DraftProposer


class FakeGrammar:
    """Accepts drafts while they are even (structured output's grammar, as drafting reads it)."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        count = 0
        for token in token_ids:
            if token % 2:
                break
            count += 1
        return count


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    max_tokens: int = 100
    num_output_tokens: int = 1
    is_finished: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    grammar: FakeGrammar | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FakeBlocks:
    def block_ids(self, request_id: str) -> list[int]:
        return {"a": [3, 4], "b": [7]}[request_id]


class FakeRunner:
    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], list[list[int]]]] = []

    def propose_drafts(
        self, last_token_ids: list[int], num_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        self.calls.append((last_token_ids, num_tokens, block_tables))
        return [[last + 1, last + 2] for last in last_token_ids]


def step(token_ids: list[list[int]], drafted: list[int]) -> StepResult:
    return StepResult(["a", "b"][: len(token_ids)], token_ids, None, 8, 0.0, drafted)


def test_only_the_runs_the_scheduler_applied_are_counted() -> None:
    proposer = DraftProposer(
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2),
        None,
    )
    a = FakeRequest("a", [1, 2, 3, 1, 2])
    # "a" verified 3 drafts and kept 2 (+1 token); "b" was aborted while its step ran.
    proposer.after_step(step([[3, 1, 9], [5]], [3, 2]), [a], [], FakeBlocks())
    stats = proposer.stats_snapshot()
    assert stats is not None
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert a.spec_token_ids == [3, 1, 2]  # prompt lookup: (1, 2) was followed by 3, 1, 2


def test_model_drafters_get_each_requests_newest_token_position_and_blocks() -> None:
    runner = FakeRunner()
    config = SpeculativeConfig(method="layer_skip", num_layers=1, num_speculative_tokens=2)
    proposer = DraftProposer.create(config, runner)
    assert proposer.num_lookahead_tokens == 2
    a, b = FakeRequest("a", [5, 6, 7]), FakeRequest("b", [8, 9])
    done = FakeRequest("b", [8, 9], is_finished=True)
    full = FakeRequest("b", [8, 9], max_tokens=2)  # one more token would reach max_tokens
    proposer.after_step(step([[7], [9]], [0, 0]), [a, b], [], FakeBlocks())
    assert runner.calls == [([7, 9], [3, 2], [[3, 4], [7]])]
    assert (a.spec_token_ids, b.spec_token_ids) == ([8, 9], [10, 11])
    proposer.after_step(step([[7], [9]], [0, 0]), [done, full], [], FakeBlocks())
    assert len(runner.calls) == 1 and done.spec_token_ids == full.spec_token_ids == []


def test_without_a_config_there_is_nothing_to_report() -> None:
    proposer = DraftProposer.create(None, FakeRunner())
    assert not proposer.enabled and proposer.num_lookahead_tokens == 0
    assert proposer.stats_snapshot() is None


def test_drafts_are_trimmed_to_the_prefix_the_grammar_accepts() -> None:
    config = SpeculativeConfig(method="layer_skip", num_layers=1, num_speculative_tokens=2)
    proposer = DraftProposer.create(config, FakeRunner())
    constrained = FakeRequest("a", [1, 2, 3], grammar=FakeGrammar())
    free = FakeRequest("b", [4, 5])
    proposer.after_step(step([[3], [5]], [0, 0]), [constrained, free], [], FakeBlocks())
    assert free.spec_token_ids == [6, 7]
    assert constrained.spec_token_ids == [4]  # 5 is odd: the grammar refuses it
