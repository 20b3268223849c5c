"""A step's plan as it travels from rank 0 to the other ranks: what changed, not every request.

The scheduler's `SchedulerOutput` holds its live `Request` objects: their whole token history, a
grammar state that cannot be pickled, timestamps the ranks never read. Sending those every step
would cost time in the context length. So, as vLLM's new/cached request data does, rank 0 sends a
request's prompt and parameters once, the first time it is scheduled, and afterwards only the
tokens the rank has not seen yet (one per decode step), its progress and the blocks added to its
block table (the whole table again after a preemption). Each rank
keeps a `Request` per live request id and updates it in place: the model runner's per-request rows
are keyed by the request object, so the same object must come back every step, and a new one only
when the id is reused after it finished (exactly when rank 0's own object changes).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.runtime.core.request import Request, RequestStatus
from kvasir.runtime.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request's fixed part, sent once. No grammar: rank 0 alone samples, so only it masks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    seed: int
    eos_token_ids: tuple[int, ...]
    lora: LoRARequest | None


@dataclass(frozen=True, slots=True)
class ScheduledDelta:
    """One `ScheduledRequest`, with the request's tokens the rank has not seen yet, and its block
    table as the rank's last copy up to `block_start` followed by `new_block_ids`."""

    request_id: str
    start: int
    num_tokens: int
    block_start: int
    new_block_ids: list[int]
    sample: bool
    spec_token_ids: list[int]
    pending_row: int
    new_token_ids: list[int]
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class RankPlan:
    """A `SchedulerOutput` in the form the ranks receive it."""

    new: list[NewRequest]
    scheduled: list[ScheduledDelta]
    num_batched_tokens: int
    preempted: list[str]
    finished_request_ids: list[str]


@dataclass(slots=True)
class _Sent:
    """What the ranks hold of one request: which object it is, its tokens, its last block table."""

    request: Request
    num_tokens: int
    block_ids: list[int]


class PlanSender:
    """Rank 0's side: remembers, per live request, what the ranks were last sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, plan: SchedulerOutput) -> RankPlan:
        # Finished ids first: an id reused in this very plan is then a new request, on both sides.
        for request_id in plan.finished_request_ids:
            self._sent.pop(request_id, None)
        new, scheduled = [], []
        for item in plan.scheduled:
            request = item.request
            known = self._sent.get(request.request_id)
            if known is None or known.request is not request:
                new.append(
                    NewRequest(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        request.max_tokens,
                        request.seed,
                        request.eos_token_ids,
                        request.lora,
                    )
                )
                sent, block_start = request.num_prompt_tokens, 0
            else:
                sent, block_start = known.num_tokens, _common_prefix(known.block_ids, item.block_ids)
            tokens = request.all_token_ids
            self._sent[request.request_id] = _Sent(request, len(tokens), item.block_ids)
            scheduled.append(
                ScheduledDelta(
                    request.request_id,
                    item.start,
                    item.num_tokens,
                    block_start,
                    item.block_ids[block_start:],
                    item.sample,
                    item.spec_token_ids,
                    item.pending_row,
                    tokens[sent:],
                    request.num_preemptions,
                )
            )
        return RankPlan(new, scheduled, plan.num_batched_tokens, plan.preempted, plan.finished_request_ids)


def _common_prefix(old: list[int], new: list[int]) -> int:
    """How much of `new` the ranks already hold: all of `old` when the table only grew (the common
    case: a block table grows until the request is preempted or ends), else nothing."""
    return len(old) if len(old) <= len(new) and new[: len(old)] == old else 0


class PlanReceiver:
    """A rank's side: the requests as rank 0 last described them, rebuilt into plans."""

    def __init__(self) -> None:
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def decode(self, wire: RankPlan) -> SchedulerOutput:
        for request_id in wire.finished_request_ids:
            request = self._requests.pop(request_id, None)
            self._block_ids.pop(request_id, None)
            if request is not None:
                request.status = RequestStatus.FINISHED_ABORTED  # lets a row sweep reclaim it
        for spec in wire.new:
            request = Request(
                spec.request_id,
                spec.prompt_token_ids,
                spec.sampling_params,
                max_tokens=spec.max_tokens,
                seed=spec.seed,
                eos_token_ids=spec.eos_token_ids,
                arrival_time=0.0,
                lora=spec.lora,
            )
            request.status = RequestStatus.RUNNING
            self._requests[spec.request_id] = request
        scheduled = []
        for delta in wire.scheduled:
            request = self._requests[delta.request_id]
            if delta.new_token_ids:
                # In place, not append_output_token: a rank keeps no per-token timestamps.
                request.output_token_ids.extend(delta.new_token_ids)
                request.all_token_ids.extend(delta.new_token_ids)
            request.num_preemptions = delta.num_preemptions
            # A new list each step: the plan owns its copy, as the scheduler's own plans do.
            block_ids = self._block_ids.get(delta.request_id, [])[: delta.block_start] + delta.new_block_ids
            self._block_ids[delta.request_id] = block_ids
            scheduled.append(
                ScheduledRequest(
                    request,
                    delta.start,
                    delta.num_tokens,
                    block_ids,
                    delta.sample,
                    delta.spec_token_ids,
                    delta.pending_row,
                )
            )
        return SchedulerOutput(scheduled, wire.num_batched_tokens, wire.preempted, wire.finished_request_ids)
