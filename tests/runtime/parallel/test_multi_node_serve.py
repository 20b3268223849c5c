"""Two "nodes" on this machine (CPU, gloo, loopback as the network): `kvasir serve` as node 0 and
`kvasir serve --headless` as node 1, as a LeaderWorkerSet group's pods run them. Greedy tokens
through the OpenAI API equal one process's; a killed worker node turns the leader's /health to 503
within 10 s and the leader exits non-zero, and so does a frozen one; a killed leader makes the
worker node exit non-zero; a worker node with no leader to reach fails in one line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.server.harness import (
    MODEL,
    TIMEOUT,
    ServerProcess,
    StderrLines,
    serve_process,
    spawn_serve,
    tiny_engine_config,
)

pytestmark = pytest.mark.slow
PROMPT = "the quick brown fox jumps over the lazy dog, again and again and again, until"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _group_flags(size: int, nnodes: int, port: int) -> list[str]:
    return [
        "--tensor-parallel-size", str(size), "--nnodes", str(nnodes),
        "--master-addr", "127.0.0.1", "--master-port", str(port),
    ]  # fmt: skip


@dataclass
class WorkerNode:
    process: subprocess.Popen[str]
    stderr: StderrLines
    health_url: str


@contextmanager
def worker_node(checkpoint: Path, node_rank: int, *flags: str) -> Iterator[WorkerNode]:
    """`kvasir serve --headless` for the tiny checkpoint, once its probe endpoint listens; killed
    at the end of the block if it is still running."""
    process, stderr = spawn_serve(checkpoint, "--headless", "--node-rank", str(node_rank), *flags)
    try:
        url = stderr.wait_for(r"/health and /ready on (http://[\d.]+:\d+)").group(1)
        yield WorkerNode(process, stderr, url)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)


@contextmanager
def group(checkpoint: Path, size: int = 2) -> Iterator[tuple[ServerProcess, WorkerNode]]:
    """Two nodes of `size / 2` ranks each: the worker node first (it waits for the leader's
    rendezvous), then the leader, yielded once it serves (only after the worker's ranks are ready)."""
    flags = _group_flags(size, 2, _free_port())
    with worker_node(checkpoint, 1, *flags) as worker, serve_process(checkpoint, *flags) as leader:
        yield leader, worker


@contextmanager
def leader_first(checkpoint: Path, *worker_flags: str) -> Iterator[tuple[subprocess.Popen[str], WorkerNode]]:
    """The same group started the other way round: the worker node only once the leader's
    rendezvous is open, so a short --distributed-timeout-seconds on the worker does not run out
    while the leader's interpreter starts. The leader is killed at the end of the block."""
    flags = _group_flags(2, 2, _free_port())
    leader, lines = spawn_serve(checkpoint, *flags)
    try:
        lines.wait_for(r"waiting for nodes \[1\] at port")  # logged once the store listens
        with worker_node(checkpoint, 1, *flags, *worker_flags) as worker:
            lines.wait_for(r"ready: serving")
            yield leader, worker
    finally:
        leader.kill()  # a stopped process would ignore a SIGTERM
        leader.wait(TIMEOUT)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")  # 4 heads, 2 KV heads: 2 and 1 per rank at two ranks


@pytest.fixture(scope="module")
def one_process(checkpoint: Path) -> Iterator[LLMEngine]:
    engine = LLMEngine(tiny_engine_config(checkpoint))
    try:
        yield engine
    finally:
        engine.close()


def _greedy(engine: LLMEngine, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].choices[0].text


def _client(leader: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{leader.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=TIMEOUT).status_code
    except httpx.TransportError:
        return None  # nobody listens any more


def test_two_nodes_give_the_tokens_of_one_process_and_stop_together(
    checkpoint: Path, one_process: LLMEngine
) -> None:
    with group(checkpoint) as (leader, worker):
        assert _status(worker.health_url + "/health") == 200
        assert _status(worker.health_url + "/ready") == 200
        assert _status(worker.health_url + "/v1/models") == 404  # no API on a headless node
        client = _client(leader)
        stream = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert "".join(chunk.choices[0].text for chunk in stream) == _greedy(one_process, PROMPT, 16)
        result = client.completions.create(
            model=MODEL,
            prompt="hello world",
            max_tokens=8,
            temperature=0,
            n=2,
            extra_body={"ignore_eos": True},
        )
        assert {choice.text for choice in result.choices} == {_greedy(one_process, "hello world", 8)}
        # The kubelet deletes a group's pods together: SIGTERM to both. The worker waits for the
        # leader, which drains and then stops every rank: both exit 0.
        worker.process.send_signal(signal.SIGTERM)
        leader.process.send_signal(signal.SIGTERM)
        assert leader.process.wait(TIMEOUT) == 0
        assert worker.process.wait(TIMEOUT) == 0
        worker.stderr.wait_for("the leader stopped the group")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_or_frozen_worker_node_fails_the_leaders_health_and_the_leader_exits(
    checkpoint: Path, how: signal.Signals
) -> None:
    with group(checkpoint) as (leader, worker):
        worker.process.send_signal(how)  # SIGSTOP: its ranks run on, the node's agent is silent
        killed_at = time.monotonic()
        statuses, deadline = set(), killed_at + TIMEOUT  # the deadline: a last guard only
        while 503 not in statuses and leader.process.poll() is None and time.monotonic() < deadline:
            status = _status(leader.url + "/health")
            if status is None:
                break  # the port closed: the leader is exiting
            statuses.add(status)
        assert 503 in statuses, "/health never answered 503 before the leader exited"
        assert time.monotonic() - killed_at < 10
        assert leader.process.wait(TIMEOUT) != 0
        leader.stderr.wait_for(r"tensor parallelism: node 1 has not answered|a call to the ranks failed")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_dead_or_frozen_leader_makes_the_worker_node_exit_non_zero(
    checkpoint: Path, how: signal.Signals
) -> None:
    """A frozen leader keeps its sockets open: the node gives up once its store calls have not
    returned for --distributed-timeout-seconds (6 s here)."""
    with leader_first(checkpoint, "--distributed-timeout-seconds", "6") as (leader, worker):
        leader.send_signal(how)
        stopped_at = time.monotonic()
        assert worker.process.wait(TIMEOUT) != 0
        assert time.monotonic() - stopped_at >= (6 if how == signal.SIGSTOP else 0)
        worker.stderr.wait_for(r"the leader at 127\.0\.0\.1:\d+ (is gone|has not answered)|rank 1 failed")
    rank_pids = [line for line in worker.stderr.seen if "(pids [" in line]
    assert rank_pids, "the worker node did not log its ranks' pids"
    for pid in rank_pids[0].split("(pids [")[1].split("]")[0].split(", "):
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_worker_node_without_a_leader_fails_in_one_line(checkpoint: Path) -> None:
    port = _free_port()  # nobody listens there
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--headless", "--node-rank", "1",
        "--model", str(checkpoint), "--port", "0", "--distributed-timeout-seconds", "2",
        *_group_flags(2, 2, port),
    ]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,  # a hang guard only: it gives up 2 s after it starts trying
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, done.stderr
    assert errors[0].endswith(
        f"cannot reach the leader's rendezvous at 127.0.0.1:{port} within 2 s "
        "(--distributed-timeout-seconds): Connection refused"
    )


def test_two_nodes_of_two_ranks_give_the_tokens_of_one_process(
    checkpoint: Path, one_process: LLMEngine
) -> None:
    """TP=4 over 2 nodes: ranks 0-1 on the leader, 2-3 on the worker node (each of the tiny model's
    2 KV heads replicated on two ranks)."""
    with group(checkpoint, size=4) as (leader, worker):
        worker.stderr.wait_for(r"ranks \[2, 3\]")
        result = _client(leader).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].text == _greedy(one_process, PROMPT, 12)
