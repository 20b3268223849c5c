"""Scheduler scenarios driven by a fake model (next token = f(all tokens so far)); no torch."""

from __future__ import annotations

import time

import pytest

from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams

EOS = 0
VOCAB = 50


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 4,
    *,
    eos: tuple[int, ...] = (),
    arrival: float = 0.0,
    **params: object,
) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    return Request(
        request_id,
        prompt,
        sampling,
        max_tokens=max_tokens,
        seed=0,
        eos_token_ids=eos,
        arrival_time=arrival,
    )


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, watermark: float = 0.0, **config: object
) -> Scheduler:
    settings: dict[str, object] = {"max_model_len": 256, "block_size": block_size, **config}
    kv = KVCacheManager(
        num_blocks,
        block_size,
        enable_prefix_caching=bool(settings.get("enable_prefix_caching", True)),
        watermark=watermark,
    )
    return Scheduler(SchedulerConfig(**settings), kv, clock=lambda: 42.0)  # type: ignore[arg-type]


def fake_model(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on every token so far."""
    value = 17
    for token in tokens:
        value = (value * 31 + token) % 1_000_003
    return 1 + value % (VOCAB - 1)  # never EOS, so runs end by length


def step(scheduler: Scheduler, model=fake_model, now: float = 0.0) -> SchedulerOutput:
    """One engine step with invariant checks."""
    output = scheduler.schedule()
    config = scheduler.config
    assert output.num_batched_tokens == sum(item.num_tokens for item in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert scheduler.num_running <= config.max_num_seqs
    sampled = {
        item.request_id: [model(item.request.all_token_ids)] for item in output.scheduled if item.sample
    }
    scheduler.update(output, sampled, now)
    scheduler.kv_cache.check_integrity()
    return output


def run_to_completion(scheduler: Scheduler, max_steps: int = 1000, model=fake_model) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        outputs.append(step(scheduler, model))
    assert not scheduler.has_unfinished_requests(), "did not finish"
    kv = scheduler.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    return outputs


def plan(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(item.request_id, item.start, item.num_tokens, item.sample) for item in output.scheduled]


# ---- configuration and admission checks ----------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_model_len": 0}, "max_model_len must be a positive integer"),
        ({"max_model_len": 8, "max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 8, "max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 8, "policy": "lifo"}, "policy must be one of fcfs, priority"),
        ({"max_model_len": 8, "long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_config_validation(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**settings)


def test_config_must_match_the_kv_cache() -> None:
    with pytest.raises(ValueError, match="block_size 16 differs"):
        Scheduler(SchedulerConfig(max_model_len=64), KVCacheManager(8, 4))


def test_rejects_requests_longer_than_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) plus max_tokens \(5\).*max_model_len \(32\)"):
        scheduler.add_request(make_request("a", list(range(30)), max_tokens=5))
    with pytest.raises(InvalidParameterError, match="prompt: the prompt is empty"):
        scheduler.add_request(make_request("b", []))
    scheduler.add_request(make_request("c", list(range(28)), max_tokens=4))  # exactly 32: fine
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(make_request("c", [1]))
    assert scheduler.num_waiting == 1


def test_rejects_requests_larger_than_the_whole_cache() -> None:
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)  # 16 token slots
    with pytest.raises(
        ValueError, match=r"needs 5 KV blocks \(17 tokens to cache\), but the KV cache has only 4"
    ):
        scheduler.add_request(make_request("a", list(range(10)), max_tokens=8))
    scheduler.add_request(make_request("b", list(range(10)), max_tokens=7))  # 16 computed: fits
    run_to_completion(scheduler)


# ---- budgets, order, chunking --------------------------------------------------------------


def test_budget_and_max_num_seqs_are_respected() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    requests = [make_request(f"r{i}", [i + 1] * 3, max_tokens=3) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    first = step(scheduler)
    assert plan(first) == [("r0", 0, 3, True), ("r1", 0, 3, True)]  # seats, not budget, stop r2
    assert scheduler.num_waiting == 2
    outputs = [first, *run_to_completion(scheduler)]
    assert all(len(output.scheduled) <= 2 for output in outputs)
    assert all(request.status is RequestStatus.FINISHED_LENGTH for request in requests)
    assert all(request.num_output_tokens == 3 for request in requests)


def test_chunked_prefill_samples_only_after_the_last_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    request = make_request("a", list(range(1, 21)), max_tokens=2)
    scheduler.add_request(request)
    steps = run_to_completion(scheduler)
    assert [plan(output) for output in steps] == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
        [("a", 20, 1, True)],
    ]
    assert request.output_token_ids == [
        fake_model(list(range(1, 21))),
        fake_model(request.all_token_ids[:21]),
    ]


def test_long_prefill_threshold_caps_one_request_per_step() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=6)
    scheduler.add_request(make_request("a", list(range(1, 15)), max_tokens=1))
    scheduler.add_request(make_request("b", list(range(1, 4)), max_tokens=1))
    assert plan(step(scheduler)) == [("a", 0, 6, False), ("b", 0, 3, True)]


def test_running_decodes_go_first_and_a_long_prompt_never_stalls_them() -> None:
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=16, max_model_len=512)
    decoders = [make_request(f"d{i}", [i + 1, 2, 3], max_tokens=30) for i in range(3)]
    for request in decoders:
        scheduler.add_request(request)
    step(scheduler)  # all three prompts in one step
    long_prompt = make_request("long", [7] * 300, max_tokens=1)
    scheduler.add_request(long_prompt)
    while not long_prompt.is_finished:
        output = step(scheduler)
        names = [item.request_id for item in output.scheduled]
        # Every unfinished decode gets its token, ahead of the prompt chunk, every step.
        unfinished = [r.request_id for r in decoders if r.times.token_times and not r.is_finished]
        live = [r.request_id for r in decoders if r.request_id in names]
        assert names[: len(live)] == live
        assert all(item.num_tokens == 1 for item in output.scheduled[: len(live)])
        assert set(unfinished) <= {*live}
        assert output.num_batched_tokens <= 16
    assert all(len(r.output_token_ids) >= 20 for r in decoders)  # they kept decoding meanwhile


# ---- prefix caching ------------------------------------------------------------------------


def test_prefix_hit_skips_computed_tokens() -> None:
    scheduler = make_scheduler()
    shared = list(range(1, 14))
    first = make_request("a", shared, max_tokens=2)
    scheduler.add_request(first)
    run_to_completion(scheduler)
    second = make_request("b", [*shared[:12], 40, 41], max_tokens=2)
    scheduler.add_request(second)
    output = step(scheduler)
    assert plan(output)[0] == ("b", 12, 2, True)
    assert second.num_cached_tokens == 12
    assert output.scheduled[0].block_ids[:3] == [0, 1, 2]  # first's freed-but-cached blocks
    run_to_completion(scheduler)
    assert scheduler.kv_cache.prefix_cache_hits == 12


def test_siblings_admitted_together_share_the_prompt() -> None:
    scheduler = make_scheduler()
    prompt = list(range(1, 12))
    siblings = [make_request(f"s{i}", prompt, max_tokens=3) for i in range(3)]
    for request in siblings:
        scheduler.add_request(request)
    output = step(scheduler)
    assert plan(output) == [("s0", 0, 11, True), ("s1", 8, 3, True), ("s2", 8, 3, True)]
    tables = [item.block_ids for item in output.scheduled]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert scheduler.kv_cache.pool.blocks[tables[0][0]].ref_count == 3
    run_to_completion(scheduler)
    assert len({tuple(r.output_token_ids) for r in siblings}) == 1


# ---- preemption ----------------------------------------------------------------------------


def _outputs(num_blocks: int, budget: int, policy: str = "fcfs") -> tuple[dict[str, list[int]], int]:
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, policy=policy)
    requests = [make_request(f"r{i}", [i + 1] * (3 + 2 * i), max_tokens=12, priority=i % 3) for i in range(6)]
    for request in requests:
        scheduler.add_request(request)
    run_to_completion(scheduler)
    return {r.request_id: r.output_token_ids for r in requests}, scheduler.num_preemptions_total


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_by_recompute_keeps_outputs_unchanged(policy: str) -> None:
    reference, preemptions = _outputs(num_blocks=256, budget=512, policy=policy)
    assert preemptions == 0
    constrained, preemptions = _outputs(num_blocks=7, budget=16, policy=policy)
    assert preemptions > 0
    assert constrained == reference


def test_preempted_request_goes_back_to_the_front_and_resumes() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a = make_request("a", [1] * 8, max_tokens=8)
    b = make_request("b", [2] * 8, max_tokens=8)
    c = make_request("c", [3], max_tokens=1)
    for request in (a, b, c):
        scheduler.add_request(request)
    step(scheduler)  # a and b take 2 blocks each; c waits for blocks
    output = step(scheduler)  # a needs a third block: b (the tail) is preempted
    assert output.preempted == ["b"] and plan(output) == [("a", 8, 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and scheduler.num_preemptions_total == 1
    assert scheduler.waiting.peek() is b  # ahead of c, which arrived later
    assert scheduler.kv_cache.block_ids("b") == []
    run_to_completion(scheduler)
    assert b.num_cached_tokens == 0 and b.num_output_tokens == 8


def test_a_request_that_is_the_tail_preempts_itself() -> None:
    scheduler = make_scheduler(num_blocks=3, max_num_batched_tokens=64)
    a = make_request("a", [1] * 3, max_tokens=8)
    b = make_request("b", [2] * 8, max_tokens=4)
    late = make_request("late", [3], max_tokens=1)
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler)  # a: 1 block, b: 2 blocks; the pool is full
    scheduler.add_request(late)
    output = step(scheduler)  # a's token fits its block; b needs a fourth block
    assert plan(output) == [("a", 3, 1, True)] and output.preempted == ["b"]
    assert b.status is RequestStatus.PREEMPTED and late.status is RequestStatus.WAITING
    run_to_completion(scheduler)
    assert b.num_output_tokens == 4


# ---- priority ------------------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival() -> None:
    scheduler = make_scheduler(policy="priority", max_num_seqs=2)
    for name, priority, arrival in [("low", 5, 0.0), ("high", -1, 2.0), ("mid", 0, 1.0), ("mid2", 0, 0.5)]:
        scheduler.add_request(make_request(name, [1, 2], max_tokens=2, priority=priority, arrival=arrival))
    assert [item.request_id for item in step(scheduler).scheduled] == ["high", "mid2"]
    assert [r.request_id for r in scheduler.running] == ["high", "mid2"]
    run_to_completion(scheduler)


def test_priority_policy_preempts_the_lowest_priority() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=4, max_num_batched_tokens=64)
    low = make_request("low", [1] * 6, max_tokens=8, priority=3, arrival=0.0)
    high = make_request("high", [2] * 8, max_tokens=8, priority=0, arrival=1.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(high)
    step(scheduler)  # the pool is full now
    assert [r.request_id for r in scheduler.running] == ["high", "low"]
    output = step(scheduler)  # high needs a block: low, admitted first but less important, goes
    assert output.preempted == ["low"] and plan(output) == [("high", 8, 1, True)]
    assert low.status is RequestStatus.PREEMPTED
    run_to_completion(scheduler)


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(policy="priority", num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    a = make_request("a", [1] * 8, max_tokens=4, priority=0, arrival=0.0)
    b = make_request("b", [2] * 8, max_tokens=4, priority=5, arrival=1.0)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    small = make_request("small", [3], max_tokens=1, priority=1, arrival=2.0)
    scheduler.add_request(small)
    output = step(scheduler)  # a preempts b; a seat and a block are free, but nobody joins
    assert output.preempted == ["b"] and plan(output) == [("a", 8, 1, True)]
    assert small.status is RequestStatus.WAITING
    output = step(scheduler)
    assert [item.request_id for item in output.scheduled] == ["a", "small"]  # priority 1 before 5
    run_to_completion(scheduler)


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("first", [1], max_tokens=1, priority=9))
    scheduler.add_request(make_request("second", [2], max_tokens=1, priority=-9))
    assert [item.request_id for item in step(scheduler).scheduled] == ["first"]


# ---- aborts --------------------------------------------------------------------------------


def test_abort_while_waiting_running_and_preempted_frees_everything() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    a = make_request("a", [1] * 8, max_tokens=8)
    b = make_request("b", [2] * 8, max_tokens=8)
    waiting = make_request("w", [3] * 12, max_tokens=1)
    for request in (a, b, waiting):
        scheduler.add_request(request)
    step(scheduler)
    step(scheduler)  # b preempted
    assert b.status is RequestStatus.PREEMPTED and a.status is RequestStatus.RUNNING
    assert waiting.status is RequestStatus.WAITING
    scheduler.finish_requests(["b", "w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.num_waiting == 0 and scheduler.waiting.peek() is None
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in (a, b, waiting))
    assert a.times.finished == 42.0
    assert scheduler.num_running == 0 and not scheduler.has_unfinished_requests()
    kv = scheduler.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    output = scheduler.schedule()
    assert output.is_empty and sorted(output.finished_request_ids) == ["a", "b", "w"]


def test_abort_between_schedule_and_update() -> None:
    scheduler = make_scheduler()
    a, b = make_request("a", [1, 2, 3]), make_request("b", [4, 5, 6])
    scheduler.add_request(a)
    scheduler.add_request(b)
    output = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    updated = scheduler.update(output, {"a": [9], "b": [9]}, 1.0)
    assert updated == [b] and a.output_token_ids == [] and a.num_computed_tokens == 0
    scheduler.kv_cache.check_integrity()
    run_to_completion(scheduler)


def test_finish_requests_needs_a_finished_status() -> None:
    with pytest.raises(ValueError, match="finished status"):
        make_scheduler().finish_requests(["a"], RequestStatus.RUNNING)


def test_schedule_twice_without_update_is_refused() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1]))
    scheduler.schedule()
    with pytest.raises(RuntimeError, match="before update"):
        scheduler.schedule()


# ---- stop conditions -----------------------------------------------------------------------


def constant(token: int):
    return lambda tokens: token


@pytest.mark.parametrize(
    ("params", "model_token", "status", "num_outputs", "stop_reason"),
    [
        ({"eos": (EOS,)}, EOS, RequestStatus.FINISHED_STOPPED, 1, None),
        ({"eos": (EOS,), "ignore_eos": True}, EOS, RequestStatus.FINISHED_LENGTH, 6, None),
        ({"eos": (EOS,), "min_tokens": 3}, EOS, RequestStatus.FINISHED_STOPPED, 3, None),
        ({"stop_token_ids": (7,)}, 7, RequestStatus.FINISHED_STOPPED, 1, 7),
        ({"stop_token_ids": (7,), "min_tokens": 2}, 7, RequestStatus.FINISHED_STOPPED, 2, 7),
        ({"eos": (EOS,), "stop_token_ids": (7,)}, 5, RequestStatus.FINISHED_LENGTH, 6, None),
    ],
)
def test_stop_conditions(params: dict, model_token: int, status, num_outputs: int, stop_reason) -> None:
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3], max_tokens=6, **params)
    scheduler.add_request(request)
    run_to_completion(scheduler, model=constant(model_token))
    assert request.status is status
    assert request.num_output_tokens == num_outputs
    assert request.stop_reason == stop_reason


def test_eos_on_the_last_allowed_token_reports_stop() -> None:
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3], max_tokens=1, eos=(EOS,))
    scheduler.add_request(request)
    run_to_completion(scheduler, model=constant(EOS))
    assert request.status is RequestStatus.FINISHED_STOPPED


def test_update_returns_new_tokens_and_records_times() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = make_request("a", list(range(1, 7)), max_tokens=2)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert request.times.first_scheduled == 42.0
    assert scheduler.update(output, {}, 1.0) == []  # a prompt chunk samples nothing
    assert request.num_computed_tokens == 4 and request.times.first_token is None
    output = scheduler.schedule()
    assert scheduler.update(output, {"a": [9]}, 3.0) == [request]
    assert request.times.first_token == 3.0 and request.num_computed_tokens == 6
    output = scheduler.schedule()
    assert scheduler.update(output, {"a": [9]}, 4.0) == [request]
    assert request.is_finished and request.times.finished == 4.0 and request.times.token_times == [3.0, 4.0]
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_update_without_a_needed_token_is_an_error() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="no sampled token for 'a'"):
        scheduler.update(scheduler.schedule(), {}, 0.0)


# ---- cost ----------------------------------------------------------------------------------


def _decoding_scheduler(waiting: int) -> Scheduler:
    """256 requests admitted and decoding, and `waiting` more queued behind them (no room left)."""
    scheduler = make_scheduler(
        num_blocks=4096, block_size=16, max_num_seqs=256, max_model_len=4096, max_num_batched_tokens=8192
    )
    for i in range(256):
        scheduler.add_request(make_request(f"run{i}", [1 + i % 40] * 20, max_tokens=2000))
    step(scheduler, model=constant(5))  # admit the 256; from now on they all decode
    for i in range(waiting):
        scheduler.add_request(make_request(f"wait{i}", [3] * 20, max_tokens=100))
    return scheduler


def _schedule_seconds(scheduler: Scheduler) -> float:
    started = time.perf_counter()
    output = scheduler.schedule()
    elapsed = time.perf_counter() - started
    assert len(output.scheduled) == 256
    scheduler.update(output, {item.request_id: [5] for item in output.scheduled}, 0.0)
    return elapsed


def test_schedule_cost_is_independent_of_the_waiting_queue() -> None:
    """A step behind 10,000 waiting requests costs about what it costs behind one. Measured against
    each other, alternating, best of 20 each: a ratio survives a busy machine, where a wall-clock
    bound (1 ms, before) failed at load 7. An O(waiting) scan would cost tens of times more."""
    crowded, alone = _decoding_scheduler(10_000), _decoding_scheduler(1)
    crowded_s, alone_s = [], []
    for _ in range(20):
        crowded_s.append(_schedule_seconds(crowded))
        alone_s.append(_schedule_seconds(alone))
    ratio = min(crowded_s) / min(alone_s)
    assert ratio < 3, f"schedule() behind 10,000 waiting: {ratio:.1f}x its cost behind one"
    assert crowded.num_waiting == 10_000


class CountingGrammar:
    """A grammar state that is complete after `length` tokens (structured output, as the scheduler
    reads it)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    @property
    def terminated(self) -> bool:
        return len(self.accepted) >= self.length

    def valid_prefix(self, token_ids: list[int]) -> int:
        return len(token_ids)

    def fill_bitmask(self, bitmask: object, first_row: int, drafts: tuple[int, ...] = ()) -> None:
        raise AssertionError("the scheduler never fills masks")


@pytest.mark.parametrize(
    ("grammar_length", "max_tokens", "reason"), [(2, 6, "stop"), (3, 3, "stop"), (9, 3, "length")]
)
def test_a_complete_grammar_ends_the_request_with_stop(
    grammar_length: int, max_tokens: int, reason: str
) -> None:
    scheduler = make_scheduler()
    request = make_request("r", [5, 6, 7], max_tokens=max_tokens)
    request.grammar = CountingGrammar(grammar_length)
    scheduler.add_request(request)
    run_to_completion(scheduler)
    assert request.status.finish_reason == reason
    assert request.grammar.accepted == request.output_token_ids  # every kept token, in order
    assert len(request.output_token_ids) == min(grammar_length, max_tokens)
