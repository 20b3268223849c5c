"""The scorer and the prefix index, as pure functions."""

from __future__ import annotations

import random

import pytest

from kvasir.router.prefix import MAX_BLOCKS, PrefixIndex, block_keys, prompt_text
from kvasir.router.scorer import Candidate, Weights, rank

W = Weights()


def _best(
    candidates: list[Candidate], matches: dict[str, int] | None = None, blocks: int = 10
) -> tuple[str, str]:
    choice = rank(candidates, matches or {}, blocks, W, random.Random(0))[0]
    return choice.url, choice.reason


def test_the_shortest_queue_wins_without_a_prefix() -> None:
    candidates = [Candidate("a", 5, 0.2, True), Candidate("b", 1, 0.2, True), Candidate("c", 3, 0.2, True)]
    assert _best(candidates) == ("b", "load")


def test_free_kv_cache_breaks_an_equal_queue() -> None:
    candidates = [Candidate("a", 2, 0.9, True), Candidate("b", 2, 0.1, True)]
    assert _best(candidates) == ("b", "load")


def test_a_cached_prefix_beats_a_slightly_longer_queue() -> None:
    candidates = [Candidate("a", 3, 0.3, True), Candidate("b", 2, 0.3, True)]
    assert _best(candidates, {"a": 10}) == ("a", "prefix")


def test_the_prefix_loses_its_pull_on_an_overloaded_backend() -> None:
    # a holds the prefix but has 12 requests against b's 2: more than 1.5x and 4 more.
    candidates = [Candidate("a", 12, 0.3, True), Candidate("b", 2, 0.3, True)]
    assert _best(candidates, {"a": 10}) == ("b", "load")
    # Within the slack (4 more) the prefix still wins.
    candidates = [Candidate("a", 6, 0.3, True), Candidate("b", 2, 0.3, True)]
    assert _best(candidates, {"a": 10})[0] == "a"


def test_unknown_metrics_never_look_idle() -> None:
    candidates = [Candidate("busy", 8, 0.95, True), Candidate("silent", 0, None, False)]
    assert _best(candidates) == ("busy", "load")
    ranked = rank(candidates, {}, 0, W, random.Random(0))
    assert [(c.url, c.reason) for c in ranked] == [("busy", "load"), ("silent", "unknown_metrics")]


def test_unreachable_backends_come_last() -> None:
    candidates = [
        Candidate("down", 0, None, False, reachable=False),
        Candidate("silent", 3, None, False),
        Candidate("ok", 9, 0.9, True),
    ]
    assert [c.url for c in rank(candidates, {}, 0, W, random.Random(0))] == ["ok", "silent", "down"]


def test_equal_candidates_are_spread() -> None:
    candidates = [Candidate(name, 0, 0.0, True) for name in "abc"]
    rng = random.Random(1)
    firsts = {rank(candidates, {}, 0, W, rng)[0].url for _ in range(60)}
    assert firsts == {"a", "b", "c"}


def test_block_keys_chain_whole_prefixes() -> None:
    one = block_keys("x" * 64 + "y" * 64 + "tail", 64)
    two = block_keys("x" * 64 + "y" * 64 + "other tail", 64)
    three = block_keys("z" * 64 + "y" * 64, 64)
    assert len(one) == 2 and one == two  # partial blocks are not keyed
    assert three[1] != one[1]  # the same block after another prefix is another key
    assert len(block_keys("a" * 64 * (MAX_BLOCKS + 5), 64)) == MAX_BLOCKS


def test_prompt_text_reads_chats_completions_and_token_ids() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "U"}]},
        ]
    }
    assert prompt_text(chat) == "<system>S\n<user>U"
    assert prompt_text({"prompt": "P"}) == "P"
    assert prompt_text({"prompt": [1, 2]}) == "1,2"
    assert prompt_text({"prompt": [[3, 4]]}) == "3,4"
    assert prompt_text({"messages": "nonsense"}) == ""


def test_the_prefix_index_matches_runs_from_the_start_and_forgets_the_oldest() -> None:
    index = PrefixIndex(capacity=4)
    index.record("a", [1, 2, 3])
    assert index.match([1, 2, 9], ["a", "b"]) == {"a": 2, "b": 0}
    assert index.match([9, 2, 3], ["a"]) == {"a": 0}  # a run starts at the first block
    index.record("a", [7, 8])  # capacity 4: key 1, the oldest, goes
    assert index.size("a") == 4
    assert index.match([1, 2], ["a"]) == {"a": 0}
    index.forget("a")
    assert index.size("a") == 0
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def test_a_new_prefix_goes_to_the_backend_remembering_the_fewest_blocks() -> None:
    candidates = [
        Candidate("full", 0, 0.0, True, remembered_blocks=90),
        Candidate("empty", 0, 0.0, True, remembered_blocks=3),
        Candidate("half", 0, 0.0, True, remembered_blocks=40),
    ]
    assert [c.url for c in rank(candidates, {}, 4, W, random.Random(0))] == ["empty", "half", "full"]
