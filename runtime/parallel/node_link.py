"""The leader and the other nodes of a multi-node group watching each other through the rendezvous.

Within one machine, rank 0 watches its ranks through their processes and pipes
(engine/ranks/supervisor.py). Across machines there is no process to wait on, so each worker node's
agent (`kvasir serve --headless`) and the leader meet in the rendezvous store the leader hosts
(`--master-addr:--master-port`), under these keys:

    kvasir/node<k>/beat      a counter node k's agent adds to every HEARTBEAT_INTERVAL_S
    kvasir/node<k>/<stage>   set once every rank of node k has reported the stage (joining, ready)
    kvasir/node<k>/failure   node k's reason, when one of its ranks died or hung
    kvasir/node<k>/stopped   set once node k's ranks have exited after the leader's Stop
    kvasir/failure           the leader's reason, when the group failed there

The leader declares a node dead on its failure key, or when its counter has not moved for
NODE_SILENCE_S (a killed or frozen machine). A node declares the leader dead on the leader's
failure key, when a store call fails (the leader's process, and its store, are gone) or when one
has not returned for --distributed-timeout-seconds (a frozen leader: a TCPStore call to a stopped
server waits on its socket, whatever the store's own timeout). Each side talks through its own
client connection: a client serialises its calls, and a blocking call of `init_process_group` on
a shared one would hold the watch up.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import time

import torch.distributed as dist

HEARTBEAT_INTERVAL_S = 0.5
# A worker node whose counter stands still this long is dead or frozen: well under the 10 s within
# which the leader's /health must fail, well over a busy machine's scheduling hiccup.
NODE_SILENCE_S = 5.0
_LEADER_FAILURE = "kvasir/failure"


def _key(node: int, what: str) -> str:
    return f"kvasir/node{node}/{what}"


def _set(store: dist.Store, key: str, value: str) -> None:
    """`store.set`, returning once the server has it: a TCPStore client sends a set without waiting
    for an answer, so a reader on another connection could still miss it; a call that is answered
    on the same connection comes back only after the server has handled the set."""
    store.set(key, value)
    store.check([key])


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client connection of its own to the rendezvous store at `host:port`."""
    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def wait_until_reachable(host: str, port: int, timeout_s: float) -> None:
    """Return once `host:port` accepts a connection; ConnectionError in one line after `timeout_s`.

    Retried in Python rather than left to TCPStore: its connect loop prints C++ stack traces on
    every failed try, and a leader's name may not resolve yet (a pod whose DNS record is not
    published) or its port not be open (a leader still starting)."""
    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConnectionError(
                f"cannot reach the leader's rendezvous at {host}:{port} within {timeout_s:g} s "
                f"(--distributed-timeout-seconds): {last}"
            )
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 2.0)):
                return
        except OSError as error:
            last = error.strerror or str(error) or type(error).__name__
        time.sleep(min(HEARTBEAT_INTERVAL_S, max(0.0, deadline - time.monotonic())))


class WorkerNodes:
    """The leader's view of nodes 1..M-1: their stages, beats and failures."""

    def __init__(self, store: dist.Store, nodes: range, stages: tuple[str, ...]) -> None:
        self._store = store
        self.nodes = list(nodes)
        self._stages = stages
        self._beats = dict.fromkeys(self.nodes, 0)
        self._moved_at: dict[int, float] = {}  # a node's clock starts at its first beat
        self._reported: dict[str, set[int]] = {stage: set() for stage in stages}

    def poll(self, now: float) -> str | None:
        """Read every node's keys; the first dead node's reason, or None."""
        for node in self.nodes:
            if self._store.check([_key(node, "failure")]):
                return (
                    f"node {node} failed: {self._store.get(_key(node, 'failure')).decode(errors='replace')}"
                )
            beat = self._store.add(_key(node, "beat"), 0)
            if beat != self._beats[node]:
                self._beats[node], self._moved_at[node] = beat, now
            elif node in self._moved_at and now - self._moved_at[node] > NODE_SILENCE_S:
                return f"node {node} has not answered for {now - self._moved_at[node]:.1f} s"
            for stage in self._stages:
                if node not in self._reported[stage] and self._store.check([_key(node, stage)]):
                    self._reported[stage].add(node)
        return None

    def missing(self, stage: str) -> list[int]:
        """The nodes that have not reported `stage` yet."""
        return [node for node in self.nodes if node not in self._reported[stage]]

    def announce_failure(self, reason: str) -> None:
        """Tell every node the group failed (best effort: they also see the store go)."""
        with contextlib.suppress(Exception):  # the nodes then see the store vanish with this process
            _set(self._store, _LEADER_FAILURE, reason)

    def all_stopped(self) -> bool:
        return all(self._store.check([_key(node, "stopped")]) for node in self.nodes)


class LeaderLink:
    """A worker node's side: its beat, stages and failure, and the leader's failure."""

    def __init__(self, store: dist.Store, node: int) -> None:
        self._store = store
        self.node = node

    def beat(self) -> None:
        self._store.add(_key(self.node, "beat"), 1)

    def report(self, stage: str) -> None:
        _set(self._store, _key(self.node, stage), "1")

    def report_failure(self, reason: str) -> None:
        _set(self._store, _key(self.node, "failure"), reason)

    def report_stopped(self) -> None:
        _set(self._store, _key(self.node, "stopped"), "1")

    def leader_failure(self) -> str | None:
        if not self._store.check([_LEADER_FAILURE]):
            return None
        return self._store.get(_LEADER_FAILURE).decode(errors="replace")
