"""The scheduler's LoRA bound and fairness, watched step by step: at most `max_loras` adapters in
the running set (so in any step), base requests free of it, and a request passed over for its
adapter never more than `max_lora_skips` steps, even a rare adapter behind a steady stream of
others, with block pressure preempting on top."""

from __future__ import annotations

import random

import pytest

from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import InvalidParameterError, SamplingParams
from tests.runtime.core.test_scheduler import make_scheduler, step


def adapter(index: int, name: str | None = None) -> LoRARequest:
    return LoRARequest(name or f"a{index}", index, f"/adapters/a{index}", bytes([index]) * 32, 8)


def lora_request(
    request_id: str, lora: LoRARequest | None, prompt_len: int = 6, max_tokens: int = 4
) -> Request:
    prompt = [1 + (hash(request_id) + i) % 40 for i in range(prompt_len)]
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, seed=0, lora=lora
    )


class Watch:
    """A scheduler hook: after every step, the bound holds and no request ages past the limit."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.max_adapters_in_a_step = 0
        self.max_skips_seen = 0
        self.preempted = 0
        self.waited: dict[str, int] = {}  # steps each request waited before its first admission

    def step(self) -> None:
        scheduler = self.scheduler
        output = step(scheduler)
        config = scheduler.config
        in_step = {item.request.lora.adapter_id for item in output.scheduled if item.request.lora}
        running = {r.lora.adapter_id for r in scheduler.running if r.lora is not None}
        assert len(in_step) <= config.max_loras
        assert len(running) <= config.max_loras
        self.max_adapters_in_a_step = max(self.max_adapters_in_a_step, len(in_step))
        self.preempted += len(output.preempted)
        for request in scheduler.requests.values():
            assert request.lora_skips <= config.max_lora_skips, request
            self.max_skips_seen = max(self.max_skips_seen, request.lora_skips)
            if request.times.first_scheduled is None:
                self.waited[request.request_id] = self.waited.get(request.request_id, 0) + 1


def test_base_requests_do_not_count_against_the_bound() -> None:
    scheduler = make_scheduler(num_blocks=256, max_loras=1)
    scheduler.add_request(lora_request("a", adapter(1)))
    scheduler.add_request(lora_request("b", adapter(2)))
    for index in range(4):
        scheduler.add_request(lora_request(f"base{index}", None))
    output = scheduler.schedule()
    # b waits for a's adapter slot; the base requests behind it go ahead.
    assert [item.request_id for item in output.scheduled] == ["a", "base0", "base1", "base2", "base3"]
    assert scheduler.lora_adapters() == (["a1"], ["a2"])
    assert scheduler.requests["b"].lora_skips == 1


def test_a_request_with_an_adapter_needs_lora_on() -> None:
    scheduler = make_scheduler()
    with pytest.raises(InvalidParameterError, match="not enabled"):
        scheduler.add_request(lora_request("a", adapter(1)))


def test_passed_over_requests_keep_their_order() -> None:
    scheduler = make_scheduler(num_blocks=256, max_loras=1)
    for request_id, index in (("x", 1), ("y", 2), ("z", 2), ("w", 1)):
        scheduler.add_request(lora_request(request_id, adapter(index)))
    output = scheduler.schedule()
    assert [item.request_id for item in output.scheduled] == ["x", "w"]
    assert [scheduler.waiting.pop().request_id for _ in range(2)] == ["y", "z"]


def test_a_starving_adapter_preempts_to_get_a_slot_within_the_bound() -> None:
    """Adapter 1 runs long requests and keeps getting more; adapter 2 waits. After max_lora_skips
    steps adapter 2 is reserved the slot, adapter 1's requests are preempted, and 2 runs."""
    scheduler = make_scheduler(num_blocks=512, max_loras=1, max_lora_skips=3, max_model_len=512)
    scheduler.add_request(lora_request("long", adapter(1), max_tokens=200))
    watch = Watch(scheduler)
    watch.step()
    scheduler.add_request(lora_request("rare", adapter(2)))
    admitted_at = None
    for number in range(1, 20):
        scheduler.add_request(lora_request(f"more{number}", adapter(1), max_tokens=200))
        watch.step()
        if scheduler.requests["rare"].status is RequestStatus.RUNNING:
            admitted_at = number
            break
    assert admitted_at == 4  # passed over in steps 1..3, admitted in the 4th
    assert watch.max_skips_seen == 3
    assert watch.preempted >= 1
    # Adapter 1's requests are waiting again, and age in turn (they do not take the slot back).
    assert scheduler.requests["long"].status is RequestStatus.PREEMPTED
    assert scheduler.lora_adapters()[0] == ["a2"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_adapters_a_steady_stream_and_a_rare_one(policy: str, seed: int) -> None:
    """12 adapters over 3 slots, a steady stream of requests, a rare adapter arriving now and then,
    base requests mixed in, and few enough KV blocks that preemption happens: every step holds the
    bound, no request is passed over more than max_lora_skips steps, and everything finishes."""
    rng = random.Random(seed)
    max_loras, skips = 3, 4
    scheduler = make_scheduler(
        num_blocks=48, max_loras=max_loras, max_lora_skips=skips, max_num_seqs=8, policy=policy
    )
    adapters = [adapter(index) for index in range(1, 13)]
    rare = adapter(99, "rare")
    watch = Watch(scheduler)
    rare_ids = []
    for number in range(300):
        for _ in range(rng.randint(0, 2)):
            choice = rng.random()
            lora = None if choice < 0.2 else adapters[rng.randrange(4 if choice < 0.9 else 12)]
            scheduler.add_request(
                lora_request(f"r{number}-{rng.random()}", lora, rng.randint(2, 12), rng.randint(1, 12))
            )
        if number % 50 == 7:
            rare_ids.append(f"rare{number}")
            scheduler.add_request(lora_request(rare_ids[-1], rare, 5, 3))
        watch.step()
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        watch.step()
    assert not scheduler.has_unfinished_requests()
    assert watch.max_adapters_in_a_step == max_loras
    assert watch.max_skips_seen == skips  # reached: the aging, not luck, admitted some requests
    # The rare adapter's requests got in: passed over at most `skips` steps, then at most one
    # reservation per other adapter ahead of it, each served within skips + 1 steps.
    rare_waits = [watch.waited.get(request_id, 0) for request_id in rare_ids]
    assert max(rare_waits) <= skips + (skips + 1) * (len(adapters) // max_loras + 1), rare_waits
    assert watch.preempted > 0
    assert scheduler.lora_adapters() == ([], [])
    kv = scheduler.kv_cache
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_an_aborted_starving_request_releases_its_reservation() -> None:
    scheduler = make_scheduler(num_blocks=256, max_loras=1, max_lora_skips=1)
    scheduler.add_request(lora_request("a", adapter(1), max_tokens=50))
    step(scheduler)
    scheduler.add_request(lora_request("b", adapter(2)))
    step(scheduler)  # b passed over once: its adapter is reserved the slot
    assert scheduler.requests["b"].lora_skips == 1
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(lora_request("c", adapter(1)))
    output = step(scheduler)
    assert not output.preempted and "c" in [item.request_id for item in output.scheduled]
    assert scheduler.lora_adapters() == (["a1"], [])


def test_scheduler_config_checks_the_lora_settings() -> None:
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_model_len=8, max_loras=-1)
    with pytest.raises(ValueError, match="max_lora_skips"):
        SchedulerConfig(max_model_len=8, max_lora_skips=0)
