"""Rank 0's view of the other ranks: spawning them, watching them, ending them.

A failed rank must become an error the orchestrator acts on, never a hang. A monitor thread
watches three things and declares the group failed on the first of them:
- a rank process exits (its sentinel), or reports an error on its pipe;
- a rank stops beating (a stopped or wedged process: its heartbeat thread is silent), after
  `HEARTBEAT_TIMEOUT_S` once it has started, or `FIRST_BEAT_S` before that (interpreter start);
- a call to the ranks has not returned within `--distributed-timeout-seconds` (a collective
  stuck with every process alive: the watchdog);
- across machines (`--nnodes`), a worker node reports a failure or its beat stands still
  (`parallel/node_link.py`).
On failure it kills every rank (rank 0's own collectives with them then fail at once instead of
waiting out their timeout) and calls the failure callbacks: the engine turns dead, `/health`
answers 503 and the server exits non-zero. A worker node's agent (`node_agent.py`) runs the same
group over its own ranks, where a rank's exit 0 (after the leader's Stop) ends the group cleanly.
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
from kvasir.runtime.parallel.node_link import WorkerNodes
from kvasir.runtime.parallel.topology import LOOPBACK, NodeLayout

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
    """This machine's ranks (all but rank 0) as child processes of this one: ranks 1..size-1 on one
    machine; with a `layout` of several nodes, this node's ranks (and `nodes`, on the leader, the
    other machines' agents, watched through the store)."""

    def __init__(
        self,
        size: int,
        rendezvous: Any,
        config: Any,
        threads: int | None,
        timeout_s: float,
        *,
        layout: NodeLayout | None = None,
        nodes: WorkerNodes | None = None,
        exit_zero_is_stop: bool = False,
    ) -> None:
        self.size = size
        # Rank 0's TCPStore (kept alive here: the ranks reach it while they run), or None on a
        # worker node, whose ranks reach the leader's at --master-addr:--master-port.
        self.rendezvous = rendezvous
        layout = layout or NodeLayout(size)
        port = rendezvous.port if rendezvous is not None else layout.master_port
        host = LOOPBACK if layout.node_rank == 0 else layout.master_addr
        self.nodes = nodes
        # A worker node's ranks exit 0 after the leader's Stop: that ends the group, it does not fail it.
        self._exit_zero_is_stop = exit_zero_is_stop
        self.stopped = threading.Event()
        self._exited: set[int] = set()
        self._leaving: set[int] = set()  # ranks whose pipe closed, their exit code not yet read
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
        for rank in layout.ranks:
            if rank == 0:
                continue  # this process
            ours, theirs = context.Pipe()
            process = context.Process(
                target=run_rank,
                args=(rank, layout.local_index(rank), size, host, port, config, threads, theirs),
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
        if self.failure is None and not self._stage_done[stage].is_set():
            missing = f"ranks {sorted(set(self.processes) - self._reported[stage])}"
            if self.nodes is not None:
                missing += f", nodes {self.nodes.missing(stage)}"
            self.fail(f"{missing} not {stage} after {timeout_s:g} s")
        if self.failure is not None:
            raise RankFailure(str(self.failure))

    def stage_reached(self, stage: str) -> bool:
        """Whether every rank (and every other node) has reported `stage`, the group alive."""
        return self._stage_done[stage].is_set() and self.failure is None

    def fail(self, reason: str) -> None:
        """Declare the group failed (the first reason wins), kill every rank, tell the callbacks."""
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = RankFailure(f"tensor parallelism: {reason}")
            callbacks, self._callbacks = self._callbacks, []
        logger.error("%s; stopping every rank", self.failure)
        if self.nodes is not None:
            self.nodes.announce_failure(str(self.failure))
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
        if self.nodes is not None and self.failure is None:
            # The store goes with this process: keep it until every node has seen its ranks leave,
            # so a node tells a clean stop from a vanished leader.
            while not self._nodes_stopped() and time.monotonic() < deadline:
                time.sleep(HEARTBEAT_INTERVAL_S / 5)
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

    def _nodes_stopped(self) -> bool:
        try:
            return self.nodes is None or self.nodes.all_stopped()
        except Exception:
            return True  # the store is gone: nothing to wait for

    def _watch(self) -> None:
        by_sentinel = {process.sentinel: rank for rank, process in self.processes.items()}
        by_pipe = {conn: rank for rank, conn in self._pipes.items()}
        while self.failure is None and not self._closing:
            for ready in wait([*by_sentinel, *by_pipe], timeout=HEARTBEAT_INTERVAL_S):
                if isinstance(ready, Connection) and ready in by_pipe:
                    rank = by_pipe[ready]
                    self._receive(rank, ready)
                    if rank in self._leaving:
                        del by_pipe[ready]
                elif isinstance(ready, int) and not self._closing:
                    self._exit(by_sentinel.pop(ready))
                if self.failure is not None or self._closing:
                    return
            now = time.monotonic()
            self._check_timeouts(now)
            self._check_nodes(now)
            for stage in STAGES:
                self._check_stage(stage)

    def _exit(self, rank: int) -> None:
        process = self.processes[rank]
        # The sentinel turns ready as the process ends, a moment before it can be reaped: its
        # exit code may still read None (measured: a clean exit after Stop, reported as None).
        process.join(_EXIT_WAIT_S)
        if process.exitcode == 0 and self._exit_zero_is_stop:
            self._exited.add(rank)
            self._last_beat.pop(rank, None)
            if self._exited == set(self.processes):
                self.stopped.set()
            return
        self.fail(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}")

    def _check_nodes(self, now: float) -> None:
        if self.nodes is None or self.failure is not None:
            return
        try:
            reason = self.nodes.poll(now)
        except Exception as error:  # this process hosts the store: should not happen
            reason = f"reading the other nodes' state failed: {type(error).__name__}: {error}"
        if reason is not None:
            self.fail(reason)

    def _check_stage(self, stage: str) -> None:
        done = len(self._reported[stage]) == len(self.processes)
        if done and (self.nodes is None or not self.nodes.missing(stage)):
            self._stage_done[stage].set()

    def _receive(self, rank: int, conn: Connection) -> None:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            if self._exit_zero_is_stop:
                # The rank is leaving; its exit code (read from its sentinel) says whether cleanly.
                self._leaving.add(rank)
                return
            if not self._closing:
                self.fail(f"rank {rank} closed its pipe (the process is exiting)")
            return
        self._last_beat[rank] = time.monotonic()
        if message[0] == "error":
            self.fail(f"rank {rank} failed: {message[1]}")
        elif message[0] in STAGES:
            self._reported[message[0]].add(rank)
            self._check_stage(message[0])

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
