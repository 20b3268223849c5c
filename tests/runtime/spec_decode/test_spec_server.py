"""`kvasir serve --speculative-config` end to end: a real server process parses vLLM's JSON, its
greedy completions equal a plain engine's token for token, and /metrics reports the drafts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.sample.params import SamplingParams
from tests.runtime.server.harness import MODEL, TIMEOUT, serve_process

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[9, 10, 11, 12, 13] * 6, [20, 21, 22] * 9 + [20], [5, 6, 7, 8]]


def test_serve_with_prompt_lookup_matches_the_plain_engine(tiny_checkpoint: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint("llama")
    plain = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", dtype="float32", max_model_len=256))
    greedy = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    expected = [result.choices[0].text for result in plain.generate(PROMPTS, [greedy] * len(PROMPTS))]

    spec = json.dumps(NGRAM)
    with (
        serve_process(checkpoint, "--dtype", "float32", "--speculative-config", spec) as server,
        httpx.Client(base_url=server.url, timeout=TIMEOUT) as client,
    ):
        for prompt, text in zip(PROMPTS, expected, strict=True):
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 24,
                "min_tokens": 24,
                "temperature": 0,
            }
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text
        metrics = client.get("/metrics").text
    drafted = _sample(metrics, "kvasir_spec_decode_num_draft_tokens_total")
    accepted = _sample(metrics, "kvasir_spec_decode_num_accepted_tokens_total")
    assert drafted > 0 and 0 < accepted <= drafted


def test_a_bad_speculative_config_is_refused_before_loading(tiny_checkpoint: Callable[..., Path]) -> None:
    import subprocess
    import sys

    bad = json.dumps({"method": "layer_skip", "num_speculative_tokens": 3})
    result = subprocess.run(
        [sys.executable, "-m", "kvasir.cli", "serve", "--model", str(tiny_checkpoint("llama")),
         "--speculative-config", bad],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 2
    assert "speculative_config.num_layers is required for method 'layer_skip'" in result.stderr


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
