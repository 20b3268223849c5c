"""A worker node of a multi-node group (`kvasir serve --headless --node-rank K`): its ranks, nothing else.

The agent is a small process that owns no shard: it waits for the leader's rendezvous
(`--master-addr:--master-port`, at most `--distributed-timeout-seconds`), spawns this node's
N/M ranks (`supervisor.RankGroup`, as the leader spawns its own; they join the group at the
leader's store and then receive every call from rank 0 like any other rank), and keeps the
leader and its ranks informed of each other (`parallel/node_link.py`):

- it beats into the store and reports each start-up stage once all its ranks have;
- a rank of its own that dies or hangs fails the node: it kills its ranks, tells the leader the
  reason (the leader's group then fails, at once) and exits 1;
- the leader failing (its failure key), vanishing (a store call fails) or freezing (a store call
  has not returned in --distributed-timeout-seconds) fails the node too, exit 1;
- its ranks exiting 0 means the leader stopped the group: it says so and exits 0.

SIGTERM does not stop it: the kubelet sends it to every pod of a group at once, and the leader
drains first and then stops the ranks itself; a node whose leader is gone after a SIGTERM exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from typing import Any

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.ranks.start import threads_per_rank
from kvasir.runtime.engine.ranks.supervisor import STAGES, RankGroup
from kvasir.runtime.parallel.node_link import (
    HEARTBEAT_INTERVAL_S,
    LeaderLink,
    store_client,
    wait_until_reachable,
)
from kvasir.runtime.parallel.topology import NodeLayout
from kvasir.runtime.threads import choose_threads

logger = logging.getLogger(__name__)

# How long telling the leader this node failed may take (a frozen leader never answers).
_REPORT_WAIT_S = 2.0


class NodeAgent:
    """Node `config.node_rank`'s ranks, and the watch between them and the leader."""

    def __init__(self, config: EngineConfig, threads: int | None = None) -> None:
        self.config = config
        self.layout = NodeLayout.of(config)
        self._threads = threads_per_rank(choose_threads(threads)[0], self.layout.ranks_per_node)
        self._timeout_s = config.distributed_timeout_seconds
        self._leader = f"{self.layout.master_addr}:{self.layout.master_port}"
        self.group: RankGroup | None = None
        self._link: LeaderLink | None = None
        self._leader_gone: str | None = None  # why the leader is considered gone, once it is
        self._answered_at = time.monotonic()  # the last store call that returned
        self._reported: set[str] = set()
        self._terminating = False
        self._done = threading.Event()  # the watch has ended: the beat thread stops

    # ---- what the health endpoint reads ---------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.group is None or self.group.failure is None

    @property
    def ready(self) -> bool:
        return self.alive and self._reported == set(STAGES)

    # ---- the node's life ------------------------------------------------------------------

    def run(self) -> int:
        """Serve this node's ranks until the leader stops them (0) or either side fails (1).
        ConnectionError (one line) when the leader cannot be reached at start."""
        layout = self.layout
        wait_until_reachable(layout.master_addr, layout.master_port, self._timeout_s)
        self._link = LeaderLink(
            store_client(layout.master_addr, layout.master_port, self._timeout_s), layout.node_rank
        )
        self._answered_at = time.monotonic()  # the leader's silence counts from its first answer
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.group = RankGroup(
            layout.size,
            None,
            self.config,
            self._threads,
            self._timeout_s,
            layout=layout,
            exit_zero_is_stop=True,
        )
        logger.info(
            "node %d of %d: ranks %s (pids %s), %d CPU threads each, driven by the leader at %s",
            layout.node_rank,
            layout.nnodes,
            list(layout.ranks),
            self.group.pids,
            self._threads,
            self._leader,
        )
        beat = threading.Thread(target=self._beat, name="kvasir-node-beat", daemon=True)
        beat.start()
        try:
            return self._watch(self.group)
        except KeyboardInterrupt:
            self._fail(self.group, "interrupted (SIGINT)")
            return 1
        finally:
            self._done.set()
            beat.join(_REPORT_WAIT_S)  # a call to a frozen leader never returns: not waited for
            self.group.close()

    def _watch(self, group: RankGroup) -> int:
        while True:
            if group.stopped.wait(HEARTBEAT_INTERVAL_S):
                self._tell_leader(lambda link: link.report_stopped())
                logger.info("the leader stopped the group: this node's ranks exited")
                return 0
            if group.failure is not None:
                self._tell_leader(lambda link: link.report_failure(str(group.failure)))
                return 1
            silent = time.monotonic() - self._answered_at
            if self._leader_gone is None and silent > self._timeout_s:
                self._leader_gone = f"the leader at {self._leader} has not answered for {silent:.0f} s (--distributed-timeout-seconds)"
            if self._leader_gone is not None:
                if self._terminating:
                    logger.info("the leader is gone after SIGTERM (%s): stopping", self._leader_gone)
                    group.fail(self._leader_gone)
                    return 0
                group.fail(self._leader_gone)
                return 1

    def _beat(self) -> None:
        """The store calls, on their own thread: a call to a frozen leader never returns, and the
        watch above must go on to notice that."""
        assert self._link is not None and self.group is not None
        while self._leader_gone is None and not self._done.is_set():
            try:
                self._link.beat()
                failure = self._link.leader_failure()
                for stage in STAGES:
                    if stage not in self._reported and self.group.stage_reached(stage):
                        self._link.report(stage)
                        self._reported.add(stage)
                        logger.info("node %d: every rank %s", self.layout.node_rank, stage)
            except Exception as error:
                self._leader_gone = f"the leader at {self._leader} is gone ({type(error).__name__}: {error})"
                return
            self._answered_at = time.monotonic()
            if failure is not None:
                self._leader_gone = f"the leader failed: {failure}"
                return
            self._done.wait(HEARTBEAT_INTERVAL_S)

    def _fail(self, group: RankGroup, reason: str) -> None:
        group.fail(reason)
        self._tell_leader(lambda link: link.report_failure(str(group.failure)))

    def _tell_leader(self, call: Any) -> None:
        """One store call to the leader, given up after _REPORT_WAIT_S (it may be frozen or gone)."""
        link = self._link
        if link is None or self._leader_gone is not None:
            return

        def send() -> None:
            with contextlib.suppress(Exception):  # the leader is gone: nobody left to tell
                call(link)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(_REPORT_WAIT_S)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self._terminating:
            logger.info("SIGTERM: this node stops when the leader stops the group (or is gone)")
        self._terminating = True
