"""`kvasir serve --async-scheduling --output-process` (the defaults on CUDA) end to end on the CPU:
completions, streamed or not, with stop strings and n > 1, equal the synchronous in-process
engine's, and a client that disconnects mid-stream leaves the KV cache empty."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.server.harness import MODEL, TIMEOUT, serve_process

PROMPTS = [[9, 10, 11, 12, 13] * 4, [20, 21, 22] * 5, [5, 6, 7, 8]]


def test_overlapped_server_matches_the_synchronous_engine(tiny_checkpoint: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint("llama")
    plain = LLMEngine(
        EngineConfig(
            model=str(checkpoint),
            device="cpu",
            dtype="float32",
            max_model_len=256,
            async_scheduling=False,
            output_process=False,
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    texts = [r.choices[0].text for r in plain.generate(PROMPTS, greedy)]
    stop = texts[0][5:8]
    stopped = plain.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=(stop,))
    )
    seeded = plain.generate(PROMPTS, SamplingParams(temperature=0.9, seed=7, max_tokens=16, n=2))

    flags = ("--dtype", "float32", "--async-scheduling", "--output-process")
    with (
        serve_process(checkpoint, *flags) as server,
        httpx.Client(base_url=server.url, timeout=TIMEOUT) as client,
    ):
        for index, prompt in enumerate(PROMPTS):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            assert _text(client, body) == texts[index]
            assert _streamed_text(client, body) == texts[index]
            choice = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (
                stopped[index].choices[0].text,
                stopped[index].choices[0].finish_reason,
            )
            sampled = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0.9,
                "seed": 7,
                "n": 2,
            }
            choices = sorted(
                client.post("/v1/completions", json=sampled).json()["choices"], key=lambda c: c["index"]
            )
            assert [c["text"] for c in choices] == [c.text for c in seeded[index].choices]
        # A client that goes away mid-stream: its request is aborted and its blocks freed.
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    break
        deadline = time.monotonic() + TIMEOUT
        while _gauge(client.get("/metrics").text, "kvasir_kv_cache_usage_ratio") > 0:
            assert time.monotonic() < deadline, "the disconnected request kept its KV blocks"
            time.sleep(0.1)


def _text(client: httpx.Client, body: dict) -> str:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _streamed_text(client: httpx.Client, body: dict) -> str:
    parts = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                parts += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(parts)


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
