"""Tracing with an in-memory exporter: one span per request, its phases, and the caller's traceparent."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvasir.runtime.server.app import build_app
from kvasir.runtime.server.config import ServerConfig
from kvasir.runtime.server.tracing import provider_from_env, tracing_enabled
from tests.runtime.server.harness import MODEL, TIMEOUT, serve, tiny_engine_config

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7


def test_request_span_continues_the_trace_and_records_its_phases(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = build_app(tiny_engine_config(tiny_checkpoint("llama")), ServerConfig(), tracer_provider=provider)
    with serve(app) as server:
        traceparent = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"
        response = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4,
                "ignore_eos": True,
            },
            headers={"traceparent": traceparent},
            timeout=TIMEOUT,
        )
        assert response.status_code == 200
        body = response.json()
        # A stream is traced too, and a request without traceparent starts its own trace.
        with httpx.stream(
            "POST",
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True},
            timeout=TIMEOUT,
        ) as stream:
            assert stream.read().endswith(b"data: [DONE]\n\n")
        server.wait_idle()

    spans = exporter.get_finished_spans()
    requests = [span for span in spans if span.name.startswith(("chat ", "text_completion "))]
    assert [span.name for span in requests] == [f"chat {MODEL}", f"text_completion {MODEL}"]
    chat, completion = requests
    assert chat.context.trace_id == TRACE_ID
    assert chat.parent is not None and chat.parent.span_id == PARENT_SPAN_ID and chat.parent.is_remote
    assert completion.context.trace_id != TRACE_ID and completion.parent is None

    attributes = dict(chat.attributes or {})
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.response.id"] == body["id"]
    assert attributes["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]  # type: ignore[operator]

    phases = sorted(
        (span for span in spans if span.parent is not None and span.parent.span_id == chat.context.span_id),
        key=lambda span: span.start_time or 0,
    )
    assert [span.name for span in phases] == ["queue", "prefill", "decode"]
    assert all(span.context.trace_id == TRACE_ID for span in phases)
    assert chat.start_time is not None and chat.end_time is not None
    # The phases tile the request: each starts where the previous ended, inside the request span.
    for earlier, later in pairwise(phases):
        assert earlier.end_time == pytest.approx(later.start_time, abs=1_000_000)
    assert phases[0].start_time == pytest.approx(chat.start_time, abs=1_000_000)
    assert phases[-1].end_time <= chat.end_time  # type: ignore[operator]


def test_tracing_is_off_unless_otel_variables_ask() -> None:
    assert not tracing_enabled({})
    assert provider_from_env({}) is None
    assert not tracing_enabled({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert not tracing_enabled({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x"})
    assert tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert tracing_enabled({"OTEL_TRACES_EXPORTER": "console"})
    provider = provider_from_env({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    assert provider is not None
    provider.shutdown()
    with pytest.raises(ValueError, match="zipkin"):
        provider_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})
