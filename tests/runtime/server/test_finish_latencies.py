"""Every finished choice, whatever ended it (length, EOS, stop string, stop token id, a client that
hangs up after the first token), streamed or not, is counted once in each latency histogram it
took part in, on a real `kvasir serve` (text side in the engine's process, or in its own with
async scheduling); and its request span has the queue, prefill and decode phases.

Stop-string finishes used to be missing from TTFT, queue time and ITL, and their spans had no
phases: the text side ended them without the engine's timing record."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from kvasir.runtime.config import EngineConfig
from kvasir.runtime.engine.llm_engine import LLMEngine
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from tests.runtime.finish_cases import PROMPT, GreedyOutput, greedy_output
from tests.runtime.server.harness import MODEL, TIMEOUT, serve, serve_process, tiny_engine_config

HISTOGRAMS = (
    "kvasir_time_to_first_token_seconds",
    "kvasir_request_queue_time_seconds",
    "kvasir_e2e_request_latency_seconds",
)


@dataclass(frozen=True)
class Case:
    name: str
    body: dict[str, Any]  # on top of the model, the prompt and greedy decoding
    finish_reason: str
    num_tokens: int  # per choice


@pytest.fixture(scope="module")
def greedy(tiny_checkpoint: Callable[..., Path]) -> GreedyOutput:
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu", max_model_len=256))
    try:
        return greedy_output(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_checkpoint: Callable[..., Path], greedy: GreedyOutput) -> Path:
    """The same weights, with a token the prompt's greedy output reaches as one more EOS id."""
    return tiny_checkpoint("llama", eos_token_id=greedy.token_ids[greedy.stop_token()])


def finish_cases(greedy: GreedyOutput) -> list[Case]:
    eos_at = greedy.stop_token()
    stop_token_at = greedy.stop_token(eos_at + 1)  # another token, so it is no EOS
    stop_token = greedy.token_ids[stop_token_at]
    stop, stop_string_at = greedy.stop_string()
    ended = {"max_tokens": 12, "ignore_eos": True}
    return [
        Case("length", {"max_tokens": 5, "ignore_eos": True}, "length", 5),
        Case("eos", {"max_tokens": 12}, "stop", eos_at + 1),
        Case("stop string", {**ended, "stop": [stop]}, "stop", stop_string_at + 1),
        Case("stop string, n=2", {**ended, "stop": [stop], "n": 2}, "stop", stop_string_at + 1),
        Case("stop token", {**ended, "stop_token_ids": [stop_token]}, "stop", stop_token_at + 1),
    ]


@dataclass
class Sent:
    finish_reasons: Counter[str] = field(default_factory=Counter)
    completion_tokens: int = 0  # reported in usage (the aborted stream has none)

    @property
    def choices(self) -> int:
        return sum(self.finish_reasons.values())


def send_every_finish(client: httpx.Client, greedy: GreedyOutput) -> Sent:
    """Each case streamed and not, then a stream its client leaves after the first token."""
    sent = Sent()
    for case in finish_cases(greedy):
        n = case.body.get("n", 1)
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, **case.body}
        for stream in (False, True):
            reasons, usage = _streamed(client, body) if stream else _whole(client, body)
            assert reasons == [case.finish_reason] * n, (case.name, stream)
            assert usage == case.num_tokens * n, (case.name, stream)
            sent.finish_reasons[case.finish_reason] += n
            sent.completion_tokens += usage
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # hang up
    sent.finish_reasons["abort"] += 1
    return sent


def _whole(client: httpx.Client, body: dict[str, Any]) -> tuple[list[str], int]:
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    choices = sorted(result["choices"], key=lambda choice: choice["index"])
    return [choice["finish_reason"] for choice in choices], result["usage"]["completion_tokens"]


def _streamed(client: httpx.Client, body: dict[str, Any]) -> tuple[list[str], int]:
    reasons: dict[int, str] = {}
    usage = None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    if choice["finish_reason"] is not None:
                        reasons[choice["index"]] = choice["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
    assert usage is not None
    return [reasons[index] for index in sorted(reasons)], usage


def _counts(client: httpx.Client) -> dict[str, float]:
    """Histogram counts, finished requests by reason and generated tokens, from /metrics."""
    counts = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name.endswith("_count"):
                counts[sample.name] = sample.value
            elif sample.name == "kvasir_requests_finished_total":
                counts[f"finished {sample.labels['finish_reason']}"] = sample.value
            elif sample.name == "kvasir_generation_tokens_total":
                counts["generation tokens"] = sample.value
    return counts


@pytest.mark.parametrize(
    "flags", [(), ("--async-scheduling", "--output-process")], ids=["in-process", "output-process"]
)
def test_every_finish_is_counted_once_in_every_latency_histogram(
    eos_checkpoint: Path, greedy: GreedyOutput, flags: tuple[str, ...]
) -> None:
    with (
        serve_process(eos_checkpoint, *flags) as server,
        httpx.Client(base_url=server.url, timeout=TIMEOUT) as client,
    ):
        before = _counts(client)
        sent = send_every_finish(client, greedy)
        # The hung-up stream is counted once the server has noticed it (and aborted it).
        e2e = "kvasir_e2e_request_latency_seconds_count"
        deadline = time.monotonic() + TIMEOUT
        while (after := _counts(client))[e2e] < before[e2e] + sent.choices:
            assert time.monotonic() < deadline, "the hung-up stream was never counted"
            time.sleep(0.05)
    counts = {name: after[name] - before[name] for name in after}
    for reason in ("length", "stop", "abort"):
        assert counts[f"finished {reason}"] == sent.finish_reasons[reason], reason
    for histogram in HISTOGRAMS:  # all of them had a first token
        assert counts[f"{histogram}_count"] == sent.choices, histogram
    # Every token after a choice's first is one gap; the aborted stream had at least one token.
    tokens = counts["generation tokens"]
    assert tokens >= sent.completion_tokens + 1
    assert counts["kvasir_inter_token_latency_seconds_count"] == tokens - sent.choices


def test_every_finish_has_the_queue_prefill_and_decode_phases(
    eos_checkpoint: Path, greedy: GreedyOutput
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = build_app(tiny_engine_config(eos_checkpoint), ServerConfig(), tracer_provider=provider)
    with serve(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT) as client:
        sent = send_every_finish(client, greedy)
        server.wait_idle()
    spans = exporter.get_finished_spans()
    requests = [span for span in spans if span.name == f"text_completion {MODEL}"]
    assert len(requests) == 2 * len(finish_cases(greedy)) + 1
    children: dict[int, list[str]] = {}
    for span in sorted(spans, key=lambda span: span.start_time or 0):
        if span.parent is not None:
            children.setdefault(span.parent.span_id, []).append(span.name)
    reasons: Counter[str] = Counter()
    for request in requests:
        reasons.update((request.attributes or {})["gen_ai.response.finish_reasons"])  # type: ignore[arg-type]
        assert children.get(request.context.span_id) == ["queue", "prefill", "decode"], request.attributes
    assert reasons == sent.finish_reasons
