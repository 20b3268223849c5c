"""OpenTelemetry tracing: one span per request, with its queue, prefill and decode phases as child spans.

Off by default and free when off (no tracer object exists, no OpenTelemetry import). It turns on
through the standard variables: `OTEL_TRACES_EXPORTER` (otlp, console; not none) or an OTLP
endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); the exporter reads
the other `OTEL_EXPORTER_OTLP_*` and `OTEL_BSP_*` variables itself. An incoming W3C `traceparent`
header makes the request span a child of the caller's span.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvasir.runtime.engine.outputs import RequestTimes
from kvasir.runtime.sample.params import SamplingParams

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span


def tracing_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for trace export."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER")
    if exporters is not None:
        return any(name.strip().lower() not in ("", "none") for name in exporters.split(","))
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def provider_from_env(env: Mapping[str, str] = os.environ) -> TracerProvider | None:
    """A TracerProvider exporting as OTEL_* says, or None when tracing is off; ValueError on a bad setting."""
    if not tracing_enabled(env):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    provider = TracerProvider(
        resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "kvasir")})
    )
    for name in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        name = name.strip().lower()
        exporter: SpanExporter
        if name in ("", "none"):
            continue
        if name == "console":
            exporter = ConsoleSpanExporter()
        elif name == "otlp":
            exporter = _otlp_exporter(env)
        else:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (use otlp, console or none)"
            )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise ValueError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the opentelemetry-exporter-otlp-proto-grpc package; "
                "install it or use http/protobuf"
            ) from None
        return GrpcSpanExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: unsupported protocol {protocol!r}")


def request_attributes(params: SamplingParams) -> dict[str, Any]:
    """The GenAI semantic-convention attributes of a request's sampling parameters."""
    return {
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.choice.count": params.n,
        "gen_ai.request.seed": params.seed,
    }


@dataclass(frozen=True)
class RequestSummary:
    """What a finished request did, for its span (and its log line)."""

    response_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reasons: tuple[str, ...]
    times: tuple[RequestTimes, ...]  # one per choice, however it ended
    error: str | None = None


class RequestTracer:
    """Starts a request's span (continuing an incoming trace) and closes it with its phases."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = provider.get_tracer("kvasir.runtime.server")
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self,
        operation: str,
        model: str,
        headers: Mapping[str, str],
        attributes: Mapping[str, Any],
        arrival: float,
    ) -> Span:
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier=dict(headers))
        return self._tracer.start_span(
            f"{operation} {model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "kvasir",
                "gen_ai.request.model": model,
                **{key: value for key, value in attributes.items() if value is not None},
            },
            start_time=_wall_ns(arrival),
        )

    def finish(self, span: Span, summary: RequestSummary, arrival: float) -> None:
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        span.set_attributes(
            {
                "gen_ai.response.id": summary.response_id,
                "gen_ai.usage.input_tokens": summary.prompt_tokens,
                "gen_ai.usage.output_tokens": summary.output_tokens,
                "gen_ai.response.finish_reasons": summary.finish_reasons,
            }
        )
        scheduled = [t.first_scheduled for t in summary.times if t.first_scheduled is not None]
        first_tokens = [t.first_token for t in summary.times if t.first_token is not None]
        finished = [t.finished for t in summary.times if t.finished is not None]
        # Across choices (and prompts): queue until the first is scheduled, prefill until the first
        # token, decode until the last choice finishes.
        phases = []
        if scheduled:
            phases.append(("queue", arrival, min(scheduled)))
            span.set_attribute("gen_ai.latency.time_in_queue", min(scheduled) - arrival)
        if scheduled and first_tokens:
            phases.append(("prefill", min(scheduled), min(first_tokens)))
            span.set_attribute("gen_ai.latency.time_to_first_token", min(first_tokens) - arrival)
        if first_tokens and finished:
            phases.append(("decode", min(first_tokens), max(finished)))
        context = set_span_in_context(span)
        for name, start, end in phases:
            child = self._tracer.start_span(name, context=context, start_time=_wall_ns(start))
            child.end(end_time=_wall_ns(max(end, start)))
        if summary.error is not None:
            span.set_status(Status(StatusCode.ERROR, summary.error))
        span.set_attribute("gen_ai.latency.e2e", time.monotonic() - arrival)
        span.end()


def _wall_ns(monotonic: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds, which spans need."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)
