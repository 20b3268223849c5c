"""Rank 0's model runner: each call the engine makes is made on every rank, in the same order.

`MirroredRunner` is a `ModelRunner` (rank 0's own shard) whose public calls first broadcast one
record (`calls.py`) over the CPU group (`parallel/call_channel.py`), then run here; the other
ranks apply the same record to their runners. One broadcast per call: the layers' collectives inside the call need no further
Python round trip. Calls come from up to three threads (the engine's, the async-scheduling
executor's, the LoRA loader's), so a lock keeps each broadcast and the call it announces together:
the ranks see the calls in the order rank 0 runs them. A call made from inside another (the
runner's `execute` calling its own `prepare_step`) is not announced again: the rank's `execute`
makes the same inner call.

With async scheduling rank 0 prepares step N+1 on the engine's thread while step N runs on the
executor's. Broadcasting there would interleave with the executor's broadcasts, so the plan is
encoded then (the requests as rank 0 saw them when it prepared), carried on the prepared step, and
sent with `run_prepared`: a rank prepares just before it runs, which builds the same inputs since
preparing reads only the plan and the rank's own rows.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.core.scheduler_output import SchedulerOutput
from kvasir.runtime.engine.ranks.calls import (
    AddLoRA,
    Execute,
    PrefetchLoRAs,
    ProposeDrafts,
    RankCall,
    RemoveLoRA,
    RunStep,
    Stop,
)
from kvasir.runtime.engine.ranks.plan_wire import PlanSender, RankPlan
from kvasir.runtime.engine.ranks.supervisor import RankFailure, RankGroup
from kvasir.runtime.loader.model_files import ModelFiles
from kvasir.runtime.lora.params import LoRARequest
from kvasir.runtime.outputs import StepResult
from kvasir.runtime.parallel.call_channel import CallChannel
from kvasir.runtime.parallel.group import TensorParallel
from kvasir.runtime.parallel.init import leave_group
from kvasir.runtime.startup_phases import StartupPhases
from kvasir.runtime.structured.stats import StructuredStats
from kvasir.runtime.worker.model_runner import ModelRunner, PreparedStep, StepOutcome

T = TypeVar("T")

# How long close() waits for a running call before giving up on a clean Stop (the ranks are then
# killed by the supervisor).
_STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class MirroredStep(PreparedStep):
    """A prepared step with the plan the other ranks will prepare it from."""

    rank_plan: RankPlan | None = None


class MirroredRunner(ModelRunner):
    """Rank 0's runner; every public call is announced to ranks 1..N-1 first."""

    def __init__(
        self,
        config: EngineConfig,
        files: ModelFiles,
        phases: StartupPhases | None,
        structured_stats: StructuredStats | None,
        parallel: TensorParallel,
        ranks: RankGroup,
    ) -> None:
        self.ranks = ranks
        self._call_lock = threading.Lock()
        self._inside = threading.local()  # per thread: a mirrored call is running on it
        self._plans = PlanSender()  # the engine's thread only: plans are encoded where they are made
        self._stopped = False
        self._channel = CallChannel(parallel)
        super().__init__(config, files, phases, structured_stats, parallel=parallel)

    # ---- the mirrored calls -----------------------------------------------------------------

    def prepare_step(self, plan: SchedulerOutput) -> PreparedStep:
        prepared = super().prepare_step(plan)
        if self._nested():
            return prepared
        fields = {field.name: getattr(prepared, field.name) for field in dataclasses.fields(PreparedStep)}
        return MirroredStep(**fields, rank_plan=self._plans.encode(plan))

    def run_prepared(self, step: PreparedStep, previous: StepOutcome | None = None) -> StepOutcome:
        if self._nested():
            return super().run_prepared(step, previous)
        if not isinstance(step, MirroredStep) or step.rank_plan is None:
            raise RuntimeError("run_prepared needs a step from this runner's prepare_step")
        return self._mirror(
            RunStep(step.rank_plan), lambda: super(MirroredRunner, self).run_prepared(step, previous)
        )

    def execute(self, plan: SchedulerOutput) -> StepResult:
        if self._nested():
            return super().execute(plan)
        return self._mirror(
            Execute(self._plans.encode(plan)), lambda: super(MirroredRunner, self).execute(plan)
        )

    def propose_drafts(
        self, last_token_ids: list[int], num_tokens: list[int], block_tables: list[list[int]]
    ) -> list[list[int]]:
        call = ProposeDrafts(last_token_ids, num_tokens, block_tables)
        return self._mirror(
            call, lambda: super(MirroredRunner, self).propose_drafts(last_token_ids, num_tokens, block_tables)
        )

    # A LoRA call's own error (a bad adapter) is the client's answer, not a broken group: the
    # ranks meet the same error and carry on.

    def add_lora(self, lora: LoRARequest) -> None:
        self._mirror(AddLoRA(lora), lambda: super(MirroredRunner, self).add_lora(lora), fatal=False)

    def remove_lora(self, adapter_id: int) -> None:
        self._mirror(
            RemoveLoRA(adapter_id), lambda: super(MirroredRunner, self).remove_lora(adapter_id), fatal=False
        )

    def prefetch_loras(self, loras: list[LoRARequest]) -> None:
        self._mirror(
            PrefetchLoRAs(list(loras)), lambda: super(MirroredRunner, self).prefetch_loras(loras), fatal=False
        )

    # ---- the group's life -----------------------------------------------------------------

    def stop_ranks(self) -> None:
        """Tell the ranks to exit (skipped when a call is stuck or the group failed), then reap them."""
        if not self._stopped and self.ranks.failure is None and self._call_lock.acquire(timeout=_STOP_WAIT_S):
            try:
                self._stopped = True
                self._channel.send(Stop())
            except Exception:
                pass  # a rank already gone: close() reaps and kills
            finally:
                self._call_lock.release()
        self.ranks.close()
        if self.ranks.busy_since is None:
            leave_group()
        # Else a call is still inside a collective on another thread (NCCL need not fail when its
        # peers die): destroying its group under it could block this thread, and with it the
        # process's exit. The group goes with the process.

    def _nested(self) -> bool:
        return bool(getattr(self._inside, "active", False))

    def _mirror(self, call: RankCall, run: Callable[[], T], *, fatal: bool = True) -> T:
        """Announce `call`, then run it here; the supervisor's watchdog times the pair. A failed
        broadcast, or (when `fatal`) a failed call, fails the group: the ranks' state is unknown."""
        with self._call_lock:
            if self.ranks.failure is not None:
                raise RankFailure(str(self.ranks.failure))
            if self._stopped:
                raise RuntimeError("the ranks were stopped")
            self.ranks.busy_since = time.monotonic()
            self._inside.active = True
            try:
                try:
                    self._channel.send(call)
                except Exception as error:
                    raise self._failed(error) from error
                try:
                    return run()
                except Exception as error:
                    if not fatal and self.ranks.failure is None:
                        raise
                    raise self._failed(error) from error
            finally:
                self._inside.active = False
                self.ranks.busy_since = None

    def _failed(self, error: Exception) -> RankFailure:
        """The group's failure, declaring it with `error` when the monitor has not yet seen why."""
        self.ranks.fail(f"a call to the ranks failed: {type(error).__name__}: {error}")
        # A fresh exception per raise: the group's record is shared by every thread that sees it.
        return RankFailure(str(self.ranks.failure or error))
