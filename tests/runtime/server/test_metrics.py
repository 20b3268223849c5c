"""/metrics after a known workload: counters equal what was sent, histograms saw every choice, promtool agrees."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvasir.observability.metric_names import ITL_BUCKETS, TTFT_BUCKETS
from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.threads import tunable_thread_counts
from tests.external_tools import tool
from tests.runtime.server.harness import MODEL, TIMEOUT, serve, tiny_engine_config

DESIGN_METRICS = (
    "kvasir_requests_running",
    "kvasir_requests_waiting",
    "kvasir_kv_cache_usage_ratio",
    "kvasir_time_to_first_token_seconds",
    "kvasir_inter_token_latency_seconds",
    "kvasir_e2e_request_latency_seconds",
    "kvasir_request_queue_time_seconds",
    "kvasir_prompt_tokens",
    "kvasir_generation_tokens",
    "kvasir_preemptions",
    "kvasir_prefix_cache_queries",
    "kvasir_prefix_cache_hits",
    "kvasir_requests_finished",
)


@pytest.fixture(scope="module")
def workload_metrics(tiny_checkpoint: Callable[..., Path]) -> tuple[str, dict[str, int]]:
    """Run a mixed workload; return the /metrics text and the totals the responses reported."""
    app = build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig())
    sent = {"prompt_tokens": 0, "completion_tokens": 0, "choices": 0}
    with serve(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
        for i in range(3):
            result = client.completions.create(
                model=MODEL, prompt=f"prompt {i}", max_tokens=4 + i, extra_body={"ignore_eos": True}
            )
            assert result.usage is not None
            sent["prompt_tokens"] += result.usage.prompt_tokens
            sent["completion_tokens"] += result.usage.completion_tokens
            sent["choices"] += 1
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = next(chunk.usage for chunk in chat if chunk.usage is not None)
        sent["prompt_tokens"] += usage.prompt_tokens
        sent["completion_tokens"] += usage.completion_tokens
        sent["choices"] += 2
        with pytest.raises(openai.BadRequestError):  # rejected requests count nowhere
            client.completions.create(model=MODEL, prompt="x", temperature=-1)
        text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    return text, sent


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    result = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            result[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return result


def test_counters_equal_the_requests_and_tokens_sent(workload_metrics: tuple[str, dict[str, int]]) -> None:
    text, sent = workload_metrics
    values = samples(text)
    model = (("model_name", MODEL),)
    assert values[("kvasir_prompt_tokens_total", model)] == sent["prompt_tokens"]
    assert values[("kvasir_generation_tokens_total", model)] == sent["completion_tokens"] == 4 + 5 + 6 + 10
    finished = (("finish_reason", "length"), ("model_name", MODEL))
    assert values[("kvasir_requests_finished_total", finished)] == sent["choices"] == 5
    for histogram in (
        "kvasir_time_to_first_token_seconds",
        "kvasir_e2e_request_latency_seconds",
        "kvasir_request_queue_time_seconds",
    ):
        assert values[(f"{histogram}_count", model)] == sent["choices"], histogram
    # Every token after a choice's first one is one inter-token gap.
    assert values[("kvasir_inter_token_latency_seconds_count", model)] == sent["completion_tokens"] - 5
    assert values[("kvasir_requests_running", model)] == 0
    assert values[("kvasir_kv_cache_usage_ratio", model)] == 0.0
    assert values[("kvasir_prefix_cache_queries_total", model)] > 0


def test_every_design_metric_is_exposed_with_slo_buckets(
    workload_metrics: tuple[str, dict[str, int]],
) -> None:
    text, _ = workload_metrics
    families = {family.name for family in text_string_to_metric_families(text)}
    assert set(DESIGN_METRICS) <= families
    assert "process_resident_memory_bytes" in text and "python_info" in text
    for slo in (0.1, 0.25, 0.5, 1.0, 2.5):
        assert slo in TTFT_BUCKETS
        assert f'kvasir_time_to_first_token_seconds_bucket{{le="{slo}",model_name="{MODEL}"}}' in text
    for slo in (0.01, 0.025, 0.05, 0.1):
        assert slo in ITL_BUCKETS
        assert f'kvasir_inter_token_latency_seconds_bucket{{le="{slo}",model_name="{MODEL}"}}' in text


def test_time_to_ready_is_reported_by_phase(workload_metrics: tuple[str, dict[str, int]]) -> None:
    # The engine's phases are its own timing, the server's add process start and warm-up; on a
    # CPU there is no kernel warm-up or CUDA graph capture to report.
    text, _ = workload_metrics
    phases = {
        dict(labels)["phase"]: value
        for (name, labels), value in samples(text).items()
        if name == "kvasir_time_to_ready_seconds"
    }
    parts = ["process", "model_files", "weights", "kv_cache", "engine_setup", "warmup"]
    assert sorted(phases) == sorted([*parts, "total"])
    assert all(phases[part] >= 0 for part in parts) and phases["weights"] > 0
    # Each phase is rounded to the millisecond: the parts add up to the total within that.
    assert sum(phases[part] for part in parts) == pytest.approx(phases["total"], abs=0.001 * len(parts))


def test_cpu_threads_are_the_ones_the_steps_run_on(workload_metrics: tuple[str, dict[str, int]]) -> None:
    # The engine runs on the CPU here: the gauge is torch's thread count (what the thread tuner sets).
    text, _ = workload_metrics
    threads = samples(text)[("kvasir_cpu_threads", (("model_name", MODEL),))]
    # torch's count is per thread (OpenMP's): this thread keeps the default, while on a busy
    # machine the engine's tuner may have moved its own thread to one of its counts.
    counts = tunable_thread_counts()
    assert threads in (counts or (torch.get_num_threads(),)) and threads >= 1


def test_promtool_accepts_the_exposition(workload_metrics: tuple[str, dict[str, int]]) -> None:
    promtool = tool("promtool")
    text, _ = workload_metrics
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stdout + result.stderr
