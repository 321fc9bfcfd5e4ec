"""OpenTelemetry tracing: each turn is a trace (turn -> round -> tool call). Off by default.

With CE_OTLP_ENDPOINT set, a process exports its spans over OTLP/HTTP (protobuf) in batches;
without it, the OpenTelemetry API is a no-op and costs next to nothing. Span attributes carry
queue wait, latency, outcome and redacted arguments, never a secret.
"""

from __future__ import annotations

from opentelemetry import trace

TRACER_NAME = "chat-engine"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def current_trace_id() -> str | None:
    """The hex trace id of the active span, or None when tracing is off."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def configure_tracing(endpoint: str | None, *, service_name: str = "chat-engine") -> object | None:
    """Install an SDK tracer provider exporting to `endpoint` (e.g. http://127.0.0.1:4318/v1/traces).
    Returns the provider (call .shutdown() to flush), or None when tracing stays off."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return provider
