"""A rank that dies, stops or sticks in a collective ends the engine with an error, never a hang;
and a rank never outlives rank 0. Each case starts its own two-rank engine on CPU (gloo)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.async_engine import AsyncEngine, EngineDeadError
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.engine.ranks.calls import RemoveLoRA
from kvasir.runtime.engine.ranks.driver import MirroredRunner
from kvasir.runtime.engine.ranks.supervisor import RankFailure, RankGroup
from kvasir.runtime.parallel.init import host_rendezvous
from kvasir.runtime.sample.params import SamplingParams

TIMEOUT = 60.0  # the last guard on every wait; each case ends on a condition long before


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")


def _config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "model": str(checkpoint),
        "device": "cpu",
        "max_model_len": 2048,
        "num_kv_blocks": 160,
        "tensor_parallel_size": 2,
        **overrides,
    }
    return EngineConfig(**values)


@contextmanager
def two_ranks(checkpoint: Path, **overrides: Any) -> Iterator[tuple[LLMEngine, MirroredRunner, Any]]:
    """An engine at TP=2, its runner and its one other rank's process; closed (ranks reaped) after."""
    engine = LLMEngine(_config(checkpoint, **overrides))
    try:
        assert isinstance(engine.runner, MirroredRunner)
        (rank,) = engine.runner.ranks.processes.values()
        yield engine, engine.runner, rank
    finally:
        engine.close()


def _failure_event(engine: LLMEngine) -> tuple[threading.Event, list[BaseException]]:
    failed, seen = threading.Event(), []

    def record(error: BaseException) -> None:
        seen.append(error)
        failed.set()

    engine.on_rank_failure(record)
    return failed, seen


def test_a_killed_rank_ends_the_stream_with_an_error_and_the_engine_dies(checkpoint: Path) -> None:
    with two_ranks(checkpoint) as (engine, _, rank):
        front = AsyncEngine(engine)
        dead = threading.Event()
        front.on_dead(lambda _: dead.set())
        try:

            async def stream_until_killed() -> int:
                params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
                received = 0
                with pytest.raises(EngineDeadError, match="tensor parallelism"):
                    async for _ in front.generate("r", params=params, prompt_token_ids=[1, 2, 3]):
                        received += 1
                        if received == 1:
                            os.kill(rank.pid, signal.SIGKILL)
                return received

            received = asyncio.run(asyncio.wait_for(stream_until_killed(), TIMEOUT))
            assert received < 2000
            assert dead.wait(TIMEOUT) and not front.is_running
        finally:
            front.shutdown()


def test_a_stopped_rank_is_declared_hung_within_ten_seconds(checkpoint: Path) -> None:
    with two_ranks(checkpoint) as (engine, _, rank):
        failed, seen = _failure_event(engine)
        stopped_at = time.monotonic()
        os.kill(rank.pid, signal.SIGSTOP)  # alive to every sentinel, silent to everything else
        assert failed.wait(TIMEOUT)
        assert time.monotonic() - stopped_at < 10  # the bound for /health to fail
        assert "has not answered" in str(seen[0])
        assert rank.exitcode == -signal.SIGKILL  # a failed group is killed, stopped or not
        with pytest.raises(RankFailure):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_the_watchdog_ends_a_collective_that_never_completes(checkpoint: Path) -> None:
    """Every process alive, rank 0 waiting on a peer that never sends: only the watchdog
    (--distributed-timeout-seconds) can end it; the call then fails instead of hanging."""
    with two_ranks(checkpoint, distributed_timeout_seconds=2) as (engine, runner, rank):
        failed, seen = _failure_event(engine)

        def stuck() -> None:  # a receive the other rank never answers, on the unbounded CPU group
            dist.recv(torch.zeros(1), src=1, group=runner.parallel.cpu_group)

        with pytest.raises(RankFailure, match="has not finished in"):
            runner._mirror(RemoveLoRA(1), stuck)  # a call the rank applies without a collective
        assert failed.wait(TIMEOUT) and "--distributed-timeout-seconds" in str(seen[0])
        assert rank.exitcode == -signal.SIGKILL


def test_ranks_exit_when_rank_0_is_killed(checkpoint: Path) -> None:
    script = textwrap.dedent(
        f"""
        import threading
        from kvasir.runtime.config import EngineConfig
        from kvasir.runtime.engine.llm_engine import LLMEngine

        if __name__ == "__main__":
            engine = LLMEngine(EngineConfig(model={str(checkpoint)!r}, device="cpu", max_model_len=128,
                                            num_kv_blocks=16, tensor_parallel_size=2))
            print(*engine.runner.ranks.pids, flush=True)
            threading.Event().wait()
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        (rank_pid,) = map(int, driver.stdout.readline().split())
        watch = os.pidfd_open(rank_pid)  # readable once the rank has exited, child of ours or not
        try:
            driver.kill()  # SIGKILL: no atexit, no finalizer, no Stop call
            readable, _, _ = select.select([watch], [], [], TIMEOUT)
            assert readable == [watch], "the rank outlived rank 0"
        finally:
            os.close(watch)
    finally:
        driver.kill()
        driver.wait(TIMEOUT)


def test_a_rank_that_fails_to_start_fails_the_start_with_its_reason() -> None:
    """The rank's own error comes up its pipe: rank 0 stops waiting at once, with the reason."""
    store = host_rendezvous(2, TIMEOUT)
    group = RankGroup(2, store, config=None, threads=1, timeout_s=TIMEOUT)  # no config: it raises
    try:
        # The reason, not the wait's bound, ends the wait: a timeout would say "not joining".
        with pytest.raises(RankFailure, match="rank 1 failed: AttributeError"):
            group.wait_for("joining", TIMEOUT)
        assert group.processes[1].exitcode is not None
    finally:
        group.close()
