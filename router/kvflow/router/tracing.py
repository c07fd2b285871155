"""OpenTelemetry traces of the gateway (docs/observability.md, "Traces").

Off unless an OTLP endpoint is configured (`--otlp-traces-endpoint`, or the standard
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`). Off, every helper
here is one `None` check: the SDK is never imported and no span object is made per request.
On, spans are sampled by a parent-based ratio sampler (a caller's sampled `traceparent` is
honoured; a root is kept with probability `--otlp-traces-sample-ratio`, or the standard
`OTEL_TRACES_SAMPLER_ARG`), batched and sent over OTLP/gRPC from a background thread.

The W3C `traceparent` of the current span travels to the workers in gRPC metadata
(`grpc_metadata`), so their spans join the gateway's trace. Prompt and completion text are
never put in a span.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from kvflow.proto.otel import TracingConfig, tracer_provider

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, Status, Tracer

log = logging.getLogger("kvflow.router.tracing")

SERVICE_NAME = "kvflow-router"
TRACEPARENT = "traceparent"
# Span kinds by name: the caller needs no OpenTelemetry import.
INTERNAL, SERVER, CLIENT = "internal", "server", "client"


_tracer: Tracer | None = None
_shutdown = None


def configure(config: TracingConfig, service_name: str = SERVICE_NAME) -> bool:
    """Set up the SDK when ``config`` names an endpoint; True when tracing is on."""
    global _tracer, _shutdown
    if config.endpoint is None:
        return False
    provider = tracer_provider(config, service_name)  # the SDK, imported only now
    _tracer = provider.get_tracer("kvflow.router")
    _shutdown = provider.shutdown  # also runs at exit (the provider registers it)
    log.info("tracing on: OTLP/gRPC to %s, sample ratio %g", config.endpoint,
             config.sample_ratio)  # fmt: skip
    return True


def is_enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush what is batched (a stop would otherwise lose the last spans)."""
    global _tracer
    if _shutdown is not None and _tracer is not None:
        _tracer = None
        _shutdown()


@contextlib.contextmanager
def _started(name: str, kind: str, context: Context | None) -> Iterator[Span | None]:
    assert _tracer is not None
    from opentelemetry.trace import SpanKind

    with _tracer.start_as_current_span(name, context=context, kind=SpanKind[kind.upper()]) as span:
        yield span


_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def span(
    name: str, kind: str = INTERNAL, context: Context | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """A span made current for the block, or None (and nothing done) when tracing is off.
    Exceptions leaving the block mark it as failed."""
    if _tracer is None:
        return _NO_SPAN
    return _started(name, kind, context)


def current_span() -> Span | None:
    """The current span when tracing is on and it records; else None."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    current = trace.get_current_span()
    return current if current.is_recording() else None


def extract(headers: Mapping[str, str]) -> Context | None:
    """A caller's W3C trace context (HTTP headers), to continue its trace; None when off."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def grpc_metadata() -> tuple[tuple[str, str], ...]:
    """The current span's `traceparent` for a worker call; () when off or outside a span."""
    if _tracer is None:
        return ()
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    value = carrier.get(TRACEPARENT)
    return ((TRACEPARENT, value),) if value else ()


def error_status(description: str) -> Status:
    from opentelemetry.trace import Status, StatusCode

    return Status(StatusCode.ERROR, description)
