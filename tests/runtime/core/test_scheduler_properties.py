"""Property-based scheduler runs over a fake *paged* model that keeps token ids in its KV slots.

The fake model writes each scheduled token into the slot its block table names and reads the
whole context back through the block table before "sampling" from it. A block handed to the wrong
request, evicted while in use or shared with a different prefix shows up as a wrong context,
so these runs check the KV cache manager's sharing and eviction end to end, not just its counters.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler import Scheduler, SchedulerConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.sample.params import SamplingParams

EOS = 0
VOCAB = 6  # tiny, so prompts repeat blocks and the prefix cache gets hits
MAX_MODEL_LEN = 48
MAX_STEPS = 3000


def next_token(context: list[int]) -> int:
    """The fake model's greedy choice: a deterministic function of the whole context."""
    value = 7
    for token in context:
        value = (value * 131 + token + 1) % 1_000_003
    return value % VOCAB


def reference_output(spec: RequestSpec) -> list[int]:
    """What a request generates with unlimited resources (an independent statement of the stop rules)."""
    tokens, output = list(spec.prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if len(output) >= spec.min_tokens and not spec.ignore_eos and token == EOS:
            return output
        if len(output) >= spec.max_tokens or len(tokens) >= MAX_MODEL_LEN:
            return output


class PagedFakeModel:
    """Stores token ids in [num_blocks][block_size] slots, as the real model stores K and V."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        size = self.block_size
        # Every layer writes the step's K/V before attention reads any of it.
        for item in output.scheduled:
            tokens = item.request.all_token_ids
            for pos in range(item.start, item.start + item.num_tokens):
                self.slots[item.block_ids[pos // size]][pos % size] = tokens[pos]
        sampled = {}
        for item in output.scheduled:
            end = item.start + item.num_tokens
            context = [self.slots[item.block_ids[pos // size]][pos % size] for pos in range(end)]
            assert context == item.request.all_token_ids[:end], f"{item.request_id} read foreign KV"
            if item.sample:
                sampled[item.request_id] = [next_token(item.request.all_token_ids[:end])]
        return sampled


@dataclass(frozen=True)
class RequestSpec:
    arrival_step: int
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    priority: int
    abort_step: int | None


@st.composite
def request_specs(draw: st.DrawFn) -> RequestSpec:
    # Prompts grow from a few shared stems, so requests share prefixes of varying length.
    stem = draw(st.sampled_from([[1, 2, 3, 4, 5] * 4, [3, 3, 3, 3] * 5, [5, 4, 1, 2] * 5]))
    prompt = stem[: draw(st.sampled_from([0, 9, 13, 16, 20]))] + draw(
        st.lists(st.integers(1, VOCAB - 1), max_size=10)
    )
    if not prompt:
        prompt = [1]
    max_tokens = draw(st.integers(1, min(16, MAX_MODEL_LEN - len(prompt))))
    return RequestSpec(
        arrival_step=draw(st.integers(0, 8)),
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        ignore_eos=draw(st.booleans()),
        priority=draw(st.integers(0, 2)),
        abort_step=draw(st.none() | st.integers(0, 40)),
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[SchedulerConfig, KVCacheManager, list[RequestSpec]]:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(24 // block_size, 96 // block_size))
    enable_prefix_caching = draw(st.sampled_from([True, True, True, False]))
    config = SchedulerConfig(
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
    )
    watermark = draw(st.sampled_from([0.0, 0.01, 0.1]))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, watermark)
    return config, kv, draw(st.lists(request_specs(), min_size=2, max_size=12))


def check_step(scheduler: Scheduler, output: SchedulerOutput, had_work: bool) -> None:
    config = scheduler.config
    assert output.num_batched_tokens == sum(item.num_tokens for item in output.scheduled)
    assert output.num_batched_tokens <= config.max_num_batched_tokens
    assert scheduler.num_running <= config.max_num_seqs
    ids = [item.request_id for item in output.scheduled]
    assert len(set(ids)) == len(ids)
    for item in output.scheduled:
        assert item.num_tokens >= 1
        assert item.sample == (item.start + item.num_tokens == item.request.num_tokens)
        if config.long_prefill_token_threshold:
            assert item.num_tokens <= config.long_prefill_token_threshold
    # Liveness: with work pending, a step always schedules or preempts something.
    assert not had_work or output.scheduled or output.preempted
    for request in scheduler.requests.values():
        if request.status is not RequestStatus.RUNNING:
            assert scheduler.kv_cache.block_ids(request.request_id) == []
    scheduler.kv_cache.check_integrity()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_invariants_and_outputs(scenario) -> None:
    config, kv, specs = scenario
    scheduler = Scheduler(config, kv)
    model = PagedFakeModel(kv.num_blocks, kv.block_size)
    requests: dict[str, tuple[Request, RequestSpec]] = {}
    for step in range(MAX_STEPS):
        for index, spec in enumerate(specs):
            if spec.arrival_step == step:
                request = Request(
                    f"r{index}",
                    spec.prompt,
                    SamplingParams(
                        max_tokens=spec.max_tokens,
                        min_tokens=spec.min_tokens,
                        ignore_eos=spec.ignore_eos,
                        priority=spec.priority,
                    ),
                    max_tokens=spec.max_tokens,
                    seed=0,
                    eos_token_ids=(EOS,),
                    arrival_time=float(step),
                )
                if -(-(len(spec.prompt) + spec.max_tokens - 1) // kv.block_size) > kv.num_blocks:
                    try:
                        scheduler.add_request(request)
                    except ValueError as error:
                        assert "KV blocks" in str(error)
                        event("rejected: larger than the cache")
                        continue
                    raise AssertionError("a request larger than the cache was accepted")
                scheduler.add_request(request)
                requests[request.request_id] = (request, spec)
        aborts = [rid for rid, (_, spec) in requests.items() if spec.abort_step == step]
        scheduler.finish_requests(aborts, RequestStatus.FINISHED_ABORTED)
        kv.check_integrity()
        if step > max(spec.arrival_step for spec in specs) and not scheduler.has_unfinished_requests():
            break
        had_work = scheduler.has_unfinished_requests()
        output = scheduler.schedule()
        check_step(scheduler, output, had_work)
        if not output.is_empty:
            scheduler.update(output, model.execute(output), float(step))
        kv.check_integrity()
    else:
        raise AssertionError(f"not finished after {MAX_STEPS} steps")

    assert kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    kv.check_integrity()
    event("preempted" if scheduler.num_preemptions_total else "no preemption")
    event("prefix hits" if kv.prefix_cache_hits else "no prefix hit")
    event(
        "aborted"
        if any(r.status is RequestStatus.FINISHED_ABORTED for r, _ in requests.values())
        else "no abort"
    )
    for request, spec in requests.values():
        assert request.is_finished
        expected = reference_output(spec)
        if request.status is RequestStatus.FINISHED_ABORTED:
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            # Chunking, preemption and prefix sharing never change what a request generates.
            assert request.output_token_ids == expected
            last = expected[-1]
            stopped = last == EOS and not spec.ignore_eos and len(expected) >= spec.min_tokens
            assert request.status is (
                RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH
            )
