"""`kvasir serve --tensor-parallel-size 2` on CPU (gloo), through the official OpenAI SDK: streaming,
n > 1 and prefix caching give what one process gives; killing a rank mid-stream ends the stream
with an error, turns /health to 503 and makes the server exit non-zero."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.server.harness import MODEL, TIMEOUT, ServerProcess, serve_process, tiny_engine_config

TP = ("--tensor-parallel-size", "2")
PROMPT = "the quick brown fox jumps over the lazy dog, again and again and again, until"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("llama")  # 4 heads: 2 per rank


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[ServerProcess]:
    with serve_process(checkpoint, *TP) as running:
        yield running
    # SIGTERM (the harness's, as the kubelet's): drained, the ranks told to stop, exit 0.
    assert running.process.returncode == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


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


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    match = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


def _rank_pids(server: ServerProcess) -> list[int]:
    for line in server.stderr.seen:
        match = re.search(r"rank pids \[([\d, ]+)\]", line)
        if match:
            return [int(pid) for pid in match.group(1).split(",")]
    raise AssertionError("the server did not log its ranks' pids")


def test_streaming_gives_the_tokens_of_one_process(client: openai.OpenAI, one_process: LLMEngine) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(chunk.choices[0].text for chunk in chunks) == _greedy(one_process, PROMPT, 16)


def test_n_choices_each_give_the_greedy_tokens(client: openai.OpenAI, one_process: LLMEngine) -> None:
    result = client.completions.create(
        model=MODEL, prompt="hello world", max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(choice.index for choice in result.choices) == [0, 1]
    assert {choice.text for choice in result.choices} == {_greedy(one_process, "hello world", 8)}


def test_a_repeated_prompt_hits_the_prefix_cache(client: openai.OpenAI, server: ServerProcess) -> None:
    prompt = PROMPT + " a prompt of several blocks, asked twice"
    before = _metric(server.url, "kvasir_prefix_cache_hits_total")
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.choices[0].text == second.choices[0].text
    assert _metric(server.url, "kvasir_prefix_cache_hits_total") > before
    assert _metric(server.url, "kvasir_tensor_parallel_size") == 2


def test_a_killed_rank_fails_the_stream_health_and_the_process(checkpoint: Path) -> None:
    with serve_process(checkpoint, *TP) as server:
        (rank_pid,) = _rank_pids(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
        stream = client.completions.create(
            model=MODEL,
            prompt="hi",
            max_tokens=240,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        finish_reasons = []
        with pytest.raises(openai.APIError, match="tensor parallelism"):
            for index, chunk in enumerate(stream):
                if index == 0:
                    os.kill(rank_pid, signal.SIGKILL)
                    killed_at = time.monotonic()
                finish_reasons.append(chunk.choices[0].finish_reason)
        assert "length" not in finish_reasons  # ended by the error, not by running its course

        statuses, deadline = set(), time.monotonic() + TIMEOUT  # the deadline: a last guard only
        with httpx.Client(timeout=TIMEOUT) as probe:
            while 503 not in statuses and server.process.poll() is None and time.monotonic() < deadline:
                try:
                    statuses.add(probe.get(server.url + "/health").status_code)
                except httpx.TransportError:
                    break  # the port closed: the server is exiting
        assert 503 in statuses, "/health never answered 503 before the server exited"
        assert time.monotonic() - killed_at < 10
        assert server.process.wait(TIMEOUT) != 0
        server.stderr.wait_for(r"tensor parallelism: rank 1 .* exited|a call to the ranks failed")


def test_a_size_the_model_cannot_split_fails_to_start_with_the_reason() -> None:
    """The embedded SmolLM2-135M has 3 KV heads: 4 ranks would replicate them, which needs a
    multiple of 3 (2 ranks split them 1 and 2)."""
    command = [
        sys.executable, "-m", "kvasir.cli", "serve", "--host", "127.0.0.1", "--port", "0",
        "--tensor-parallel-size", "4",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONSAFEPATH": "1", "KVASIR_THREADS": "1"}
    finished = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT, check=False)
    assert finished.returncode == 1
    assert (
        "--tensor-parallel-size 4 must be a multiple of the number of key/value heads (3)" in finished.stderr
    )
