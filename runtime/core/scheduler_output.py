"""What the scheduler decided for one step: the data handed from the scheduler to the model runner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvasir.runtime.core.request import Request
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.sample.params import SamplingRow


class OutputGrammar(Protocol):
    """What the layers read of a request's grammar state (structured output): the scheduler
    advances it, the model runner fills token bitmasks from it, the drafter trims drafts to it.
    `kvasir.runtime.structured.matcher.GrammarState` is one."""

    def accept(self, token_id: int) -> None: ...
    @property
    def terminated(self) -> bool: ...
    def valid_prefix(self, token_ids: Sequence[int]) -> int: ...
    def fill_bitmask(self, bitmask: Any, first_row: int, drafts: Sequence[int] = ()) -> None: ...


class RequestView(SamplingRow, Protocol):
    """What the worker and the sampler may read of a scheduled request: what sampling reads, plus
    its identity and state. The scheduler's `Request` is one; their own functions take this
    protocol, so they import nothing of the scheduler's (they read a request, never change it)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def is_finished(self) -> bool: ...
    @property
    def grammar(self) -> OutputGrammar | None: ...
    @property
    def lora(self) -> LoRARequest | None: ...


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: tokens `request.all_token_ids[start : start + num_tokens]`."""

    request: Request  # the worker reads it as a RequestView
    start: int  # num_computed_tokens before the step: the position of the first scheduled token
    num_tokens: int
    block_ids: list[int]  # the request's whole block table, a copy owned by this step
    sample: bool  # the step reaches the request's last known token, so it yields the next one
    # Draft tokens verified this step, after the last known token (their positions follow it);
    # `num_tokens` counts them. Empty without speculation.
    spec_token_ids: list[int] = field(default_factory=list)
    # Async scheduling: this step was planned while the previous one ran, and the request's first
    # input token is the one the previous step samples in this row of its output (-1: known). The
    # token is fed in on the device; `request.all_token_ids` does not hold it yet.
    pending_row: int = -1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_draft_tokens(self) -> int:
        return len(self.spec_token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The step's batch, in execution order, and what changed since the previous step."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str]  # requests preempted by recompute this step (they hold no blocks now)
    # Requests finished or aborted since the previous step: per-request state elsewhere can go.
    finished_request_ids: list[str]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
