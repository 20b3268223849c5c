"""Rank 0's view of the other ranks: spawning them, watching them, ending them.

A failed rank must become an error the orchestrator acts on, never a hang. A monitor thread
watches three things and declares the group failed on the first of them:
- a rank process exits (its sentinel), or reports an error on its pipe;
- a rank stops beating (a stopped or wedged process: its heartbeat thread is silent), after
  `HEARTBEAT_TIMEOUT_S` once it has started, or `FIRST_BEAT_S` before that (interpreter start);
- a call to the ranks has not returned within `--distributed-timeout-seconds` (a collective
  stuck with every process alive: the watchdog).
On failure it kills every rank (rank 0's own collectives with them then fail at once instead of
waiting out their timeout) and calls the failure callbacks: the engine turns dead, `/health`
answers 503 and the server exits non-zero.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from kvasir.runtime.engine.ranks.rank_main import HEARTBEAT_INTERVAL_S, run_rank

logger = logging.getLogger(__name__)

# A started rank beats every 0.5 s; this much silence means it is stopped or wedged. Kept well
# under the 10 s within which /health must fail, and well over a busy machine's scheduling hiccup.
HEARTBEAT_TIMEOUT_S = 5.0
# A rank's first beat comes once its interpreter has started and imported the rank's module (a
# second or two; more on a loaded machine).
FIRST_BEAT_S = 60.0
# What a rank reports on its way up, in order.
STAGES = ("joining", "ready")
# How long close() waits for a rank to leave after Stop before it is killed.
_EXIT_WAIT_S = 10.0


class RankFailure(RuntimeError):
    """A rank died, hung or failed: the group cannot run another step."""


class RankGroup:
    """Ranks 1..size-1 as child processes of this one (rank 0)."""

    def __init__(
        self, size: int, rendezvous: Any, config: Any, threads: int | None, timeout_s: float
    ) -> None:
        self.size = size
        self.rendezvous = rendezvous  # rank 0's TCPStore: the ranks reach it on its port while they run
        self.timeout_s = timeout_s
        self.failure: RankFailure | None = None
        self._callbacks: list[Callable[[RankFailure], None]] = []
        self._lock = threading.Lock()
        # Ranks that reported each start-up stage ("joining": about to join the groups; "ready":
        # runner built), and an event set when all have (or the group failed).
        self._reported: dict[str, set[int]] = {stage: set() for stage in STAGES}
        self._stage_done = {stage: threading.Event() for stage in STAGES}
        self._closing = False
        self.busy_since: float | None = None  # set by the mirrored runner while a call runs
        context = multiprocessing.get_context("spawn")
        self.processes: dict[int, BaseProcess] = {}
        self._pipes: dict[int, Connection] = {}
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_rank,
                args=(rank, size, rendezvous.port, config, threads, theirs),
                name=f"kvasir-rank{rank}",
                daemon=True,  # multiprocessing ends it at exit, whatever path the exit takes
            )
            process.start()
            theirs.close()  # only the child holds it now: its exit is EOF here, and ours is EOF there
            self.processes[rank] = process
            self._pipes[rank] = ours
        # Before its first beat a rank is starting its interpreter: it gets FIRST_BEAT_S for that.
        started = time.monotonic()
        self._last_beat = {rank: started + FIRST_BEAT_S - HEARTBEAT_TIMEOUT_S for rank in self.processes}
        self._monitor = threading.Thread(target=self._watch, name="kvasir-rank-monitor", daemon=True)
        self._monitor.start()

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes.values() if process.pid is not None]

    def on_failure(self, callback: Callable[[RankFailure], None]) -> None:
        """Call `callback(failure)` (on the monitor's thread) when the group fails; at once if it has."""
        with self._lock:
            failure = self.failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def wait_for(self, stage: str, timeout_s: float) -> None:
        """Block until every rank has reported `stage` ("joining", "ready"); RankFailure if one
        failed meanwhile, or if `timeout_s` passed first (the group is then failed)."""
        self._stage_done[stage].wait(timeout_s)
        if self.failure is None and len(self._reported[stage]) < len(self.processes):
            self.fail(
                f"ranks {sorted(set(self.processes) - self._reported[stage])} not {stage} after {timeout_s:g} s"
            )
        if self.failure is not None:
            raise RankFailure(str(self.failure))

    def fail(self, reason: str) -> None:
        """Declare the group failed (the first reason wins), kill every rank, tell the callbacks."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = RankFailure(f"tensor parallelism: {reason}")
            callbacks, self._callbacks = self._callbacks, []
        logger.error("%s; stopping every rank", self.failure)
        self._kill_all()
        for done in self._stage_done.values():
            done.set()
        for callback in callbacks:
            try:
                callback(self.failure)
            except Exception:
                logger.exception("a rank-failure callback failed")

    def close(self) -> None:
        """After the Stop call (or a failure): reap every rank, killing those that linger."""
        with self._lock:
            self._closing = True
        deadline = time.monotonic() + _EXIT_WAIT_S
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        for conn in self._pipes.values():
            conn.close()

    def _kill_all(self) -> None:
        for process in self.processes.values():
            if process.exitcode is None:
                process.kill()
        for process in self.processes.values():
            process.join(timeout=5)

    def _watch(self) -> None:
        by_sentinel = {process.sentinel: rank for rank, process in self.processes.items()}
        by_pipe = {conn: rank for rank, conn in self._pipes.items()}
        while self.failure is None and not self._closing:
            for ready in wait([*by_sentinel, *by_pipe], timeout=HEARTBEAT_INTERVAL_S):
                if ready in by_pipe:
                    self._receive(by_pipe[ready], ready)
                elif not self._closing:
                    rank = by_sentinel[ready]  # type: ignore[index]
                    exitcode = self.processes[rank].exitcode
                    self.fail(f"rank {rank} (pid {self.processes[rank].pid}) exited with code {exitcode}")
                if self.failure is not None or self._closing:
                    return
            self._check_timeouts(time.monotonic())

    def _receive(self, rank: int, conn: Connection) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            if not self._closing:
                self.fail(f"rank {rank} closed its pipe (the process is exiting)")
            return
        self._last_beat[rank] = time.monotonic()
        if message[0] == "error":
            self.fail(f"rank {rank} failed: {message[1]}")
        elif message[0] in STAGES:
            reported = self._reported[message[0]]
            reported.add(rank)
            if len(reported) == len(self.processes):
                self._stage_done[message[0]].set()

    def _check_timeouts(self, now: float) -> None:
        for rank, beat in self._last_beat.items():
            if now - beat > HEARTBEAT_TIMEOUT_S:
                self.fail(
                    f"rank {rank} (pid {self.processes[rank].pid}) has not answered for {now - beat:.1f} s"
                )
                return
        busy = self.busy_since
        if busy is not None and now - busy > self.timeout_s:
            self.fail(
                f"a call to the ranks has not finished in {now - busy:.0f} s "
                "(--distributed-timeout-seconds): a collective is stuck"
            )
