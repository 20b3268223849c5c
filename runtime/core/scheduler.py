"""Iteration-level scheduling over the paged KV cache: one token budget per step, no phases.

Every request has computed `num_computed_tokens` of its tokens and wants to catch up. Running
requests go first, in order (a decode wants 1 token, an unfinished prompt a chunk); waiting ones
fill what is left of the budget, so a long prompt is chunked (chunked prefill) and never stalls
the decodes. When blocks run out, the most recently admitted (FCFS) or lowest-priority running
request is preempted by recompute: its blocks are freed and it later recomputes its tokens,
mostly from the prefix cache. Pure policy: no torch, no model.

LoRA: the requests running hold at most `max_loras` distinct adapters (base requests hold none),
so no step ever runs more. A waiting request whose adapter finds no free slot is passed over (the
requests behind it may go first) and ages: it is passed over at most `max_lora_skips` steps. Then
its adapter joins the reservations: free slots go to reserved adapters first, in the order they
started to starve, no other adapter takes one, and if none is free the running requests of the
active adapter with the fewest of them are preempted to free it (docs/lora.md).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvasir.runtime.config import SCHEDULING_POLICIES
from kvasir.runtime.core.kv_cache.manager import KVCacheManager
from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.request_queue import QUEUE_BY_POLICY, RequestQueue
from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import InvalidParameterError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Per-step limits and the admission policy."""

    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 256  # running requests at most
    max_model_len: int  # prompt + output tokens of one request at most
    block_size: int = 16
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # a key of QUEUE_BY_POLICY
    long_prefill_token_threshold: int = 0  # tokens one request may take per step; 0: no cap
    # KV slots held beyond a request's scheduled tokens for a drafter that writes the KV of the
    # tokens it proposes (draft model, layer skip): the speculative tokens per step, else 0.
    num_lookahead_tokens: int = 0
    # Distinct LoRA adapters the running requests may hold (0: LoRA off, adapter requests refused).
    max_loras: int = 0
    # Steps a waiting request may be passed over for its adapter before that adapter is reserved
    # the next slot (preempting another adapter's requests if it must).
    max_lora_skips: int = 8

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "block_size",
            "max_lora_skips",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be a non-negative integer (0: no cap), got {threshold!r}"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(
                f"max_loras must be a non-negative integer (0: LoRA off), got {self.max_loras!r}"
            )


class Scheduler:
    """Decides each step which requests run and how many tokens each; owns the request lifecycle."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.block_size != kv_cache.block_size:
            raise ValueError(
                f"block_size {config.block_size} differs from the KV cache's {kv_cache.block_size}"
            )
        if config.enable_prefix_caching != kv_cache.enable_prefix_caching:
            raise ValueError("enable_prefix_caching differs between the scheduler and the KV cache")
        self.config = config
        self.kv_cache = kv_cache
        self._clock = clock
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: RequestQueue = QUEUE_BY_POLICY[config.policy]()
        # Admission order (FCFS) or (priority, arrival) order: either way the tail goes first.
        self.running: list[Request] = []
        self._finished_ids: list[str] = []  # since the last schedule()
        self._num_preemptions = 0
        self._awaiting_update = False
        # LoRA: requests per adapter id, running and waiting; the adapters by id (for their names);
        # adapters reserved the next free slot, in the order they started to starve.
        self._lora_running: dict[int, int] = {}
        self._lora_waiting: dict[int, int] = {}
        self._loras: dict[int, LoRARequest] = {}
        self._reserved: dict[int, Request] = {}
        # Adapters admitted through a reservation, and the step they were: not preempted for another
        # reservation within max_lora_skips steps of it.
        self._granted: dict[int, int] = {}
        self._num_steps = 0  # schedule() and schedule_ahead() calls

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; ValueError if it is empty, too long, or cannot fit the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        if request.status is not RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"only a new request can be added, got {request!r}")
        if request.num_prompt_tokens == 0:
            raise InvalidParameterError("prompt", "the prompt is empty")
        if request.max_tokens < 1:
            raise InvalidParameterError("max_tokens", f"must be at least 1, got {request.max_tokens}")
        total = request.num_prompt_tokens + request.max_tokens
        if total > self.config.max_model_len:
            raise InvalidParameterError(
                "max_tokens",
                f"the prompt ({request.num_prompt_tokens} tokens) plus max_tokens ({request.max_tokens}) "
                f"is {total} tokens, more than max_model_len ({self.config.max_model_len})",
            )
        # The last token is sampled but never computed, so total - 1 tokens need KV slots. A request
        # larger than the whole cache would wait (or preempt itself) forever.
        blocks_needed = -(-(total - 1) // self.kv_cache.block_size)
        if blocks_needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} needs {blocks_needed} KV blocks ({total - 1} tokens to "
                f"cache), but the KV cache has only {self.kv_cache.num_blocks}"
            )
        if request.lora is not None:
            if not self.config.max_loras:
                raise InvalidParameterError("model", "LoRA adapters are not enabled on this engine")
            self._lora_enter(self._lora_waiting, request.lora)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests in any state (abort, or a stop string found); unknown ids are ignored."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status}")
        now = self._clock()
        finished_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status is RequestStatus.RUNNING:
                finished_running = True
            else:
                self.waiting.discard(request)
            self._finish(request, status, now)
        if finished_running:
            self.running = [request for request in self.running if not request.is_finished]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests, preempted ones included."""
        return len(self.waiting)

    @property
    def num_preemptions_total(self) -> int:
        return self._num_preemptions

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The names of the adapters with running requests, and of those with waiting ones."""
        running = [self._loras[adapter_id].name for adapter_id in self._lora_running]
        waiting = [self._loras[adapter_id].name for adapter_id in self._lora_waiting]
        return running, waiting

    def has_lora_requests(self, adapter_id: int) -> bool:
        """Whether any unfinished request (running or waiting) runs with this adapter."""
        return adapter_id in self._lora_running or adapter_id in self._lora_waiting

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step. Costs O(running + admitted), never O(waiting)."""
        if self._awaiting_update:
            raise RuntimeError("schedule() called again before update() of the previous step")
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._num_steps += 1
        # A starving adapter's slot, freed before the running requests are scheduled.
        lora_preempted = self._free_reserved_slots() if self._reserved else []

        # This loop runs for every running request on every step: it keeps to locals and plain
        # attributes, and only enters the preemption loop when the first allocation fails.
        allocate = self.kv_cache.allocate_slots
        running = self.running  # _allocate_or_preempt pops from this same list
        index = 0
        lookahead = self.config.num_lookahead_tokens
        while index < len(running) and budget > 0:
            request = running[index]
            num_new_tokens = self._chunk_size(
                len(request.all_token_ids) - request.num_computed_tokens, budget
            )
            drafts = self._take_drafts(request, num_new_tokens, budget) if request.spec_token_ids else []
            num_slots_ahead = len(drafts) + lookahead
            if not allocate(request, num_new_tokens, num_lookahead_tokens=num_slots_ahead) and (
                not self._allocate_or_preempt(request, num_new_tokens, num_slots_ahead, preempted)
            ):
                break
            scheduled.append(self._scheduled(request, num_new_tokens, drafts))
            budget -= num_new_tokens + len(drafts)
            index += 1

        # Admitting while preempting would hand the freed blocks to newcomers and thrash.
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)

        finished_ids, self._finished_ids = self._finished_ids, []
        self._awaiting_update = bool(scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted=lora_preempted + preempted,
            finished_request_ids=finished_ids,
        )

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """Plan the step after `in_flight` while it still runs (async scheduling).

        A request that samples in `in_flight` takes that token as this step's input, fed in on the
        device (`ScheduledRequest.pending_row`); chunked prefills continue from where `in_flight`
        leaves them; waiting requests are admitted as usual. Returns None when the plan needs the
        in-flight step's tokens on the host first: a preemption, speculative decoding, or a request
        whose sampling reads its own history (penalties). The caller then waits, updates and
        calls `schedule()`. A request that turns out to finish in `in_flight` (EOS, a stop) costs
        one wasted row here; `update()` drops its token.
        """
        if self.config.num_lookahead_tokens or any(item.spec_token_ids for item in in_flight.scheduled):
            return None
        if self._reserved and self._slots_short():
            return None  # a starving adapter needs a preemption: decide it with the tokens known
        self._num_steps += 1
        pending_rows: dict[str, int] = {}
        for item in in_flight.scheduled:
            request = item.request
            if request.is_finished:
                continue
            if item.sample:
                if _reads_history(request):
                    return None
                pending_rows[request.request_id] = len(pending_rows)
            # What the in-flight step computes; update() will set the same value.
            request.num_computed_tokens = item.start + item.num_tokens
        # The rows count every sampled item of the step, finished ones included.
        row = 0
        for item in in_flight.scheduled:
            if item.sample:
                if item.request_id in pending_rows:
                    pending_rows[item.request_id] = row
                row += 1

        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        allocate = self.kv_cache.allocate_slots
        max_model_len = self.config.max_model_len
        for request in self.running:
            if budget <= 0:
                break
            pending_row = pending_rows.get(request.request_id, -1)
            if pending_row < 0:
                num_new_tokens = self._chunk_size(
                    len(request.all_token_ids) - request.num_computed_tokens, budget
                )
                if not allocate(request, num_new_tokens):
                    return None  # preemption: decide it with the tokens known
                scheduled.append(self._scheduled(request, num_new_tokens))
                budget -= num_new_tokens
                continue
            num_known = len(request.all_token_ids)
            if request.num_output_tokens + 1 >= request.max_tokens or num_known + 1 >= max_model_len:
                continue  # the in-flight token is its last: nothing more to compute
            # One slot past the known tokens, for the pending token (never offered to the cache).
            if not allocate(request, 0, num_lookahead_tokens=1):
                return None
            start = request.num_computed_tokens
            block_ids = self.kv_cache.block_ids(request.request_id)
            scheduled.append(ScheduledRequest(request, start, 1, block_ids, True, [], pending_row))
            budget -= 1
        budget = self._admit_waiting(budget, scheduled)
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted=[],
            finished_request_ids=finished_ids,
        )

    def update(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]], now: float
    ) -> list[Request]:
        """Apply a step's results; returns the requests that got tokens (finished ones included).

        A request gets one token per step, or with speculation its accepted drafts plus one: they
        are appended in order and the stop checks run after each, so an EOS, stop token or length
        limit inside an accepted run ends the request at that token and drops the rest.
        """
        self._awaiting_update = False
        updated: list[Request] = []
        any_finished = False
        for item in output.scheduled:
            request = item.request
            if request.is_finished:  # finished (aborted) after schedule(): its blocks are gone
                continue
            if not item.sample:
                request.num_computed_tokens = item.start + item.num_tokens
                continue
            try:
                token_ids = sampled_token_ids[request.request_id]
            except KeyError:
                raise ValueError(f"no sampled token for {request.request_id!r}, which needs one") from None
            status = None
            grammar = request.grammar
            for token_id in token_ids:
                request.append_output_token(token_id, now)
                if grammar is not None:
                    grammar.accept(token_id)
                status = self._check_stop(request, token_id)
                if (
                    status is not RequestStatus.FINISHED_STOPPED
                    and grammar is not None
                    and grammar.terminated
                ):
                    # The grammar is complete: a stop, even on the last token max_tokens allowed.
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    break
            # Every token but the newest has its KV computed: the step's own tokens up to the
            # last accepted draft. Rejected drafts' slots are beyond this and get overwritten.
            request.num_computed_tokens = len(request.all_token_ids) - 1
            updated.append(request)
            if status is not None:
                self._finish(request, status, now)
                any_finished = True
        if any_finished:
            self.running = [request for request in self.running if not request.is_finished]
        return updated

    # ---- helpers ----------------------------------------------------------------------------

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        num_tokens = min(num_remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_tokens, threshold) if threshold else num_tokens

    def _scheduled(
        self, request: Request, num_new_tokens: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        start = request.num_computed_tokens
        # Positional: keyword arguments cost a measurable share of a 256-request step.
        return ScheduledRequest(
            request,  # request
            start,  # start
            num_new_tokens + len(drafts) if drafts else num_new_tokens,  # num_tokens
            self.kv_cache.block_ids(request.request_id),  # block_ids
            start + num_new_tokens == len(request.all_token_ids),  # sample
            drafts if drafts else [],  # spec_token_ids
        )

    def _take_drafts(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The request's proposed drafts this step may verify: only after its last known token
        (a decode), and no more than the budget, max_tokens and the context length leave room
        for (each accepted draft is an output token, and one more token always follows)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if request.num_computed_tokens + num_new_tokens != len(request.all_token_ids):
            return []
        room = min(
            budget - num_new_tokens,
            request.max_tokens - len(request.output_token_ids) - 1,
            self.config.max_model_len - len(request.all_token_ids) - 1,
        )
        return drafts[: max(room, 0)]

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int, preempted: list[str]
    ) -> bool:
        """Get blocks for `request`, preempting from the tail; False if `request` itself went."""
        while not self.kv_cache.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
        ):
            # The tail was not scheduled yet this step: requests are scheduled head first.
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        if request.lora is not None:
            self._lora_leave(self._lora_running, request.lora)
            self._lora_enter(self._lora_waiting, request.lora)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.push_front(request)
        logger.debug("preempted %s (%d preemptions so far)", request.request_id, self._num_preemptions)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        """Admit waiting requests in policy order while budget, seats and blocks last.

        A request whose adapter finds no slot is set aside (at most max_num_seqs of them a step)
        and the ones behind it go on; the set-aside ones go back in front, in their order."""
        skipped: list[Request] = []
        try:
            return self._admit_in_order(budget, scheduled, skipped)
        finally:
            for request in reversed(skipped):
                self.waiting.push_front(request)

    def _admit_in_order(self, budget: int, scheduled: list[ScheduledRequest], skipped: list[Request]) -> int:
        max_num_seqs = self.config.max_num_seqs
        while budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            lora = request.lora
            if lora is not None and not self._lora_fits(lora):
                if len(skipped) >= max_num_seqs:
                    break  # bounded work per step: the rest wait for a later step
                skipped.append(self.waiting.pop())
                self._passed_over(request)
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new_tokens = self._chunk_size(request.num_tokens - num_cached, budget)
            if not self.kv_cache.allocate_slots(
                request,
                num_new_tokens,
                computed_blocks,
                is_new_admission=True,
                num_lookahead_tokens=self.config.num_lookahead_tokens,
            ):
                break  # no skipping ahead: a smaller request behind it must not starve it
            self.waiting.pop()
            if lora is not None:
                self._lora_leave(self._lora_waiting, lora)
                self._lora_enter(self._lora_running, lora)
                if self._reserved.pop(lora.adapter_id, None) is not None:
                    self._granted[lora.adapter_id] = self._num_steps
                request.lora_skips = 0
            if request.status is RequestStatus.WAITING:  # first admission, not a resume
                request.num_cached_tokens = num_cached
                request.times.first_scheduled = self._clock()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if self.config.policy == "priority":
                bisect.insort(self.running, request, key=_priority_key)
            else:
                self.running.append(request)
            scheduled.append(self._scheduled(request, num_new_tokens))
            budget -= num_new_tokens
        return budget

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status the newly sampled token leads to, or None to go on."""
        params = request.sampling_params
        num_output_tokens = len(request.output_token_ids)
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output_tokens >= request.max_tokens or len(request.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Mark finished and free the blocks; the caller takes it out of `running` or `waiting`."""
        lora = request.lora
        if lora is not None:
            running = request.status is RequestStatus.RUNNING
            self._lora_leave(self._lora_running if running else self._lora_waiting, lora)
            if self._reserved.get(lora.adapter_id) is request:
                del self._reserved[lora.adapter_id]
        request.status = status
        request.times.finished = now
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # ---- LoRA slots -------------------------------------------------------------------------

    def _lora_enter(self, counts: dict[int, int], lora: LoRARequest) -> None:
        counts[lora.adapter_id] = counts.get(lora.adapter_id, 0) + 1
        self._loras[lora.adapter_id] = lora

    def _lora_leave(self, counts: dict[int, int], lora: LoRARequest) -> None:
        adapter_id = lora.adapter_id
        left = counts[adapter_id] - 1
        if left:
            counts[adapter_id] = left
            return
        del counts[adapter_id]
        if counts is self._lora_running:
            self._granted.pop(adapter_id, None)
        if adapter_id not in self._lora_running and adapter_id not in self._lora_waiting:
            del self._loras[adapter_id]

    def _lora_fits(self, lora: LoRARequest) -> bool:
        """Whether admitting a request of this adapter keeps the running adapters within max_loras.
        Free slots go to the reserved (starving) adapters first, in the order they started to starve."""
        adapter_id = lora.adapter_id
        if adapter_id in self._lora_running:
            return True
        free = self.config.max_loras - len(self._lora_running)
        if free <= 0:
            return False
        for position, reserved_id in enumerate(self._reserved):
            if position >= free:
                return False
            if reserved_id == adapter_id:
                return True
        return len(self._reserved) < free

    def _passed_over(self, request: Request) -> None:
        """Age a request its adapter kept waiting. At max_lora_skips its adapter joins the
        reservations, and from then on it waits its turn there: it is not passed over any more."""
        lora = request.lora
        assert lora is not None  # only adapter requests are passed over
        if request.lora_skips < self.config.max_lora_skips:
            request.lora_skips += 1
            if request.lora_skips < self.config.max_lora_skips:
                return
        self._reserved.setdefault(lora.adapter_id, request)

    def _slots_short(self) -> int:
        """How many running adapters must go so that the first max_loras reserved ones have slots."""
        max_loras = self.config.max_loras
        return max(0, min(len(self._reserved), max_loras) - (max_loras - len(self._lora_running)))

    def _free_reserved_slots(self) -> list[str]:
        """Preempt the running requests of as many adapters as the reserved ones lack slots: each
        time the adapter with the fewest running requests (the latest admitted on a tie). An adapter
        that got its slot through a reservation keeps it for max_lora_skips steps (no ping-pong)."""
        short = self._slots_short()
        if not short:
            return []
        protected_after = self._num_steps - self.config.max_lora_skips
        last_position = {}
        for position, request in enumerate(self.running):
            lora = request.lora
            if lora is not None and self._granted.get(lora.adapter_id, protected_after) <= protected_after:
                last_position[lora.adapter_id] = position
        victims = sorted(last_position, key=lambda a: (self._lora_running[a], -last_position[a]))[:short]
        if not victims:
            return []
        chosen = set(victims)
        keep, preempted = [], []
        for request in self.running:
            if request.lora is not None and request.lora.adapter_id in chosen:
                preempted.append(request)
            else:
                keep.append(request)
        self.running = keep
        for request in reversed(preempted):  # push_front: the earliest admitted ends up first
            self._preempt(request)
        logger.debug(
            "preempted %d requests of %d adapters for starving adapters", len(preempted), len(victims)
        )
        return [request.request_id for request in preempted]


def _reads_history(request: Request) -> bool:
    """Whether sampling the request's next token reads its output so far (penalties, or a
    grammar whose mask depends on every token): a step planned before the previous token is
    known could not build its sampling row."""
    params = request.sampling_params
    return (
        request.grammar is not None
        or params.repetition_penalty != 1.0
        or bool(params.presence_penalty)
        or bool(params.frequency_penalty)
    )


def _priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.times.arrival
