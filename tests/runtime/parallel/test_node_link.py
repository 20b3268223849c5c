"""A multi-node group's pieces without processes: the flags and their refusals, which ranks a node
runs, and the leader and a worker node watching each other through a real rendezvous store (time
passed in, so a silent node is declared dead without waiting for it)."""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Iterator

import pytest

from kvasir.runtime.engine.ranks.supervisor import STAGES
from kvasir.runtime.engine_args import add_engine_args, engine_config_from_args
from kvasir.runtime.parallel.init import host_rendezvous
from kvasir.runtime.parallel.node_link import (
    NODE_SILENCE_S,
    LeaderLink,
    WorkerNodes,
    store_client,
    wait_until_reachable,
)
from kvasir.runtime.parallel.topology import LOOPBACK, NodeLayout
from kvasir.runtime.server.config import add_server_args, server_config_from_args
from kvasir.runtime.server.headless import check_node_role


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvasir serve", exit_on_error=False)
    add_engine_args(parser)
    add_server_args(parser)
    return parser.parse_args(["--model", "/m", *argv])


def test_each_node_runs_its_share_of_the_ranks() -> None:
    config = engine_config_from_args(
        _serve_args(
            "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "leader"
        )
    )
    layout = NodeLayout.of(config)
    assert (layout.ranks_per_node, list(layout.ranks), layout.master_addr, layout.master_port) == (
        2,
        [2, 3],
        "leader",
        29501,  # vLLM's default --master-port
    )
    assert [layout.local_index(rank) for rank in layout.ranks] == [0, 1]  # cuda:0 and cuda:1 there
    assert [layout.node_of(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert list(layout.worker_nodes) == [1]
    # One node: the rendezvous stays on a loopback port the kernel picks, whatever the flags say.
    single = NodeLayout.of(
        engine_config_from_args(_serve_args("--tensor-parallel-size", "2", "--master-addr", "x"))
    )
    assert (single.multi_node, list(single.ranks), single.master_addr, single.master_port) == (
        False,
        [0, 1],
        LOOPBACK,
        0,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--tensor-parallel-size", "3", "--nnodes", "2"),
            "--tensor-parallel-size 3 does not divide evenly over --nnodes 2",
        ),
        (
            ("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "2"),
            r"--node-rank 2 is out of range for --nnodes 2 \(0 to 1\)",
        ),
        (
            (
                "--pipeline-parallel-size",
                "2",
            ),
            "--pipeline-parallel-size 2: pipeline parallelism is not implemented",
        ),
    ],
)
def test_a_group_that_cannot_be_laid_out_is_refused_naming_the_flags(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(_serve_args(*argv))


def test_node_zero_serves_and_the_others_are_headless() -> None:
    def role(*argv: str) -> None:
        args = _serve_args(*argv)
        check_node_role(engine_config_from_args(args), server_config_from_args(args))

    role("--tensor-parallel-size", "2", "--nnodes", "2")
    role("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1", "--headless")
    with pytest.raises(ValueError, match="--node-rank 1 only runs its ranks: add --headless"):
        role("--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1")
    with pytest.raises(ValueError, match="--headless runs a node above 0"):
        role("--headless")


def test_an_unreachable_leader_is_one_line_after_the_timeout() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    began = time.monotonic()
    with pytest.raises(ConnectionError) as error:
        wait_until_reachable(LOOPBACK, port, 1.0)
    assert 1.0 <= time.monotonic() - began < 30  # the upper bound: a hang guard only
    assert str(error.value) == (
        f"cannot reach the leader's rendezvous at {LOOPBACK}:{port} within 1 s "
        "(--distributed-timeout-seconds): Connection refused"
    )


@pytest.fixture
def store_port() -> Iterator[int]:
    store = host_rendezvous(2, 30.0)
    yield store.port
    del store


def test_the_leader_sees_a_nodes_stages_beats_and_stop(store_port: int) -> None:
    nodes = WorkerNodes(store_client(LOOPBACK, store_port, 30.0), range(1, 3), STAGES)
    first, second = (LeaderLink(store_client(LOOPBACK, store_port, 30.0), node) for node in (1, 2))
    assert nodes.poll(0.0) is None and nodes.missing("joining") == [1, 2]
    # A node that has not beaten yet is starting (its wait is bounded by the start-up timeout).
    assert nodes.poll(1000.0) is None
    first.beat()
    first.report("joining")
    assert nodes.poll(1000.0) is None
    assert nodes.missing("joining") == [2]
    second.beat()
    second.report("joining")
    assert nodes.poll(1001.0) is None and nodes.missing("joining") == []
    assert not nodes.all_stopped()
    first.report_stopped()
    second.report_stopped()
    assert nodes.all_stopped()


def test_a_silent_node_is_dead_after_the_silence_bound(store_port: int) -> None:
    nodes = WorkerNodes(store_client(LOOPBACK, store_port, 30.0), range(1, 2), STAGES)
    link = LeaderLink(store_client(LOOPBACK, store_port, 30.0), 1)
    link.beat()
    assert nodes.poll(10.0) is None
    assert nodes.poll(10.0 + NODE_SILENCE_S - 0.1) is None
    link.beat()  # it moved: the clock restarts
    assert nodes.poll(10.0 + NODE_SILENCE_S + 1) is None
    assert (
        nodes.poll(10.0 + 2 * NODE_SILENCE_S + 2) == f"node 1 has not answered for {NODE_SILENCE_S + 1:.1f} s"
    )


def test_failures_travel_both_ways(store_port: int) -> None:
    nodes = WorkerNodes(store_client(LOOPBACK, store_port, 30.0), range(1, 2), STAGES)
    link = LeaderLink(store_client(LOOPBACK, store_port, 30.0), 1)
    assert link.leader_failure() is None
    link.report_failure("tensor parallelism: rank 1 (pid 42) exited with code -9")
    assert nodes.poll(0.0) == "node 1 failed: tensor parallelism: rank 1 (pid 42) exited with code -9"
    nodes.announce_failure("tensor parallelism: rank 0 could not start")
    assert link.leader_failure() == "tensor parallelism: rank 0 could not start"


def test_a_rendezvous_port_in_use_is_refused_naming_the_flag(store_port: int) -> None:
    with pytest.raises(
        ValueError, match=rf"rendezvous cannot listen on --master-port {store_port}: .*address already in use"
    ):
        host_rendezvous(2, 5.0, store_port)
