"""The model-runner calls rank 0 mirrors to the other ranks: one small record per call.

Every `ModelRunner` call the engine makes on rank 0 is made on every rank, with the same arguments
in the same order (the sharded layers' collectives pair up only then). Rank 0 broadcasts one record
per call; a rank applies it to its own runner. Each record carries its own `apply`, so a rank
dispatches on the record's type, never on a method's name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvasir.runtime.engine.ranks.plan_wire import PlanReceiver, RankPlan
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.worker.model_runner import ModelRunner, StepOutcome

logger = logging.getLogger(__name__)


class RankState:
    """What a rank keeps between calls: its runner, its copy of the requests, the last step's
    outcome (the next step's placeholder tokens are read from it, as on rank 0)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.plans = PlanReceiver()
        self.previous: StepOutcome | None = None
        self.stopped = False


class RankCall(Protocol):
    def apply(self, rank: RankState) -> None: ...


@dataclass(frozen=True, slots=True)
class RunStep:
    """`prepare_step` then `run_prepared`: the async-scheduling pair, sent as one call when rank 0
    runs the step (rank 0 prepares ahead on another thread; a rank prepares just before)."""

    plan: RankPlan

    def apply(self, rank: RankState) -> None:
        prepared = rank.runner.prepare_step(rank.plans.decode(self.plan))
        rank.previous = rank.runner.run_prepared(prepared, rank.previous)


@dataclass(frozen=True, slots=True)
class Execute:
    """`execute`: a step run synchronously (speculative decoding's verification among them)."""

    plan: RankPlan

    def apply(self, rank: RankState) -> None:
        rank.runner.execute(rank.plans.decode(self.plan))


@dataclass(frozen=True, slots=True)
class ProposeDrafts:
    last_token_ids: list[int]
    num_tokens: list[int]
    block_tables: list[list[int]]

    def apply(self, rank: RankState) -> None:
        rank.runner.propose_drafts(self.last_token_ids, self.num_tokens, self.block_tables)


# LoRA calls: a bad adapter fails the same way on rank 0, which answers the client; a rank only
# logs it (its copy of the adapter is never used, since rank 0 never schedules it).


def _logged(what: str, call: Callable[[], None]) -> None:
    try:
        call()
    except Exception as error:
        logger.warning("%s on this rank failed: %s", what, error)


@dataclass(frozen=True, slots=True)
class AddLoRA:
    lora: LoRARequest

    def apply(self, rank: RankState) -> None:
        _logged(f"adding adapter {self.lora.name}", lambda: rank.runner.add_lora(self.lora))


@dataclass(frozen=True, slots=True)
class RemoveLoRA:
    adapter_id: int

    def apply(self, rank: RankState) -> None:
        _logged(f"removing adapter {self.adapter_id}", lambda: rank.runner.remove_lora(self.adapter_id))


@dataclass(frozen=True, slots=True)
class PrefetchLoRAs:
    loras: list[LoRARequest]

    def apply(self, rank: RankState) -> None:
        _logged("prefetching adapters", lambda: rank.runner.prefetch_loras(self.loras))


@dataclass(frozen=True, slots=True)
class Stop:
    """The engine closed: the rank leaves its loop and exits 0."""

    def apply(self, rank: RankState) -> None:
        rank.stopped = True
