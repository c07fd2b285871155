"""OpenTelemetry spans of a worker's requests (docs/observability.md, "Traces").

A worker traces only requests that arrive with a W3C `traceparent` in their gRPC metadata
(the gateway's worker-attempt span), and only when an OTLP endpoint is configured
(`--otlp-traces-endpoint`, or OTel's standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` /
`OTEL_EXPORTER_OTLP_ENDPOINT`). Off, `parent_from` is one `None` check per request and the
SDK is never imported.

The spans are recorded after the fact, when a request finishes, from the engine's own
timings (queued, first token, end; the same numbers the final GenerateResponse carries):
nothing runs per token or per engine step. The sampler is parent-based, so the gateway's
sampling decision holds here. Prompt and completion tokens are never put in a span.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from kvflow.engine_worker.wire_context import request_context
from kvflow.proto import worker_pb2 as pb
from kvflow.proto.otel import TracingConfig, tracer_provider
from kvflow.proto.roles import Role

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Tracer

log = logging.getLogger("kvflow.engine_worker.tracing")

SERVICE_NAME = "kvflow-worker"
TRACEPARENT = "traceparent"
_NS_PER_S = 1_000_000_000


_tracer: Tracer | None = None


def configure(config: TracingConfig, service_name: str = SERVICE_NAME) -> bool:
    """Set up the SDK when ``config`` names an endpoint; True when tracing is on."""
    global _tracer
    if config.endpoint is None:
        return False
    provider = tracer_provider(config, service_name)
    _tracer = provider.get_tracer("kvflow.engine_worker")
    log.info("tracing on: OTLP/gRPC to %s", config.endpoint)
    return True


class _HasMetadata(Protocol):
    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


def parent_from(context: _HasMetadata) -> Context | None:
    """The caller's trace context from a call's gRPC metadata; None when off or none was
    sent (the request is then not traced here)."""
    if _tracer is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == TRACEPARENT:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            text = value.decode("latin-1") if isinstance(value, bytes) else value
            return TraceContextTextMapPropagator().extract({TRACEPARENT: text})
    return None


def _child(name: str, context: Context, start_ns: int, end_ns: int, **attrs: int) -> None:
    assert _tracer is not None
    span = _tracer.start_span(name, context=context, start_time=start_ns, attributes=attrs)
    span.end(end_time=max(start_ns, end_ns))


def record_generate(
    parent: Context,
    request: pb.GenerateRequest,
    final: pb.GenerateResponse,
    info: pb.WorkerInfo,
    end_ns: int | None = None,
) -> None:
    """The spans of a finished Generate: kvflow.worker.generate with queue, prefill (or
    kv_transfer: the wait for a prefill worker's blocks, then the local tail) and decode."""
    if _tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    end_ns = time.time_ns() if end_ns is None else end_ns
    t = final.timings
    arrival_ns = end_ns - round(t.e2e_s * _NS_PER_S)
    scheduled_ns = arrival_ns + round(t.queued_s * _NS_PER_S)
    first_token_ns = arrival_ns + round(t.ttft_s * _NS_PER_S)
    usage = final.usage
    span = _tracer.start_span(
        "kvflow.worker.generate",
        context=parent,
        kind=SpanKind.SERVER,
        start_time=arrival_ns,
        attributes={
            "kvflow.worker_request_id": request.request_id,
            "kvflow.tenant": request_context(request).tenant,
            "kvflow.worker.role": Role.from_pb(info.role).value,
            "kvflow.worker.instance_id": info.instance_id,
            "gen_ai.request.model": info.model,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "kvflow.usage.cached_tokens": usage.cached_tokens,
            "kvflow.usage.remote_tokens": usage.remote_tokens,
            "kvflow.num_preemptions": t.num_preemptions,
            "gen_ai.response.finish_reasons": [pb.FinishReason.Name(final.finish_reason)],
        },
    )
    inside = trace.set_span_in_context(span)
    _child("kvflow.queue", inside, arrival_ns, scheduled_ns)
    if usage.remote_tokens > 0:
        _child("kvflow.kv_transfer", inside, scheduled_ns, first_token_ns,
               **{"kvflow.usage.remote_tokens": usage.remote_tokens})  # fmt: skip
    else:
        _child("kvflow.prefill", inside, scheduled_ns, first_token_ns,
               **{"kvflow.usage.cached_tokens": usage.cached_tokens})  # fmt: skip
    _child("kvflow.decode", inside, first_token_ns, end_ns,
           **{"gen_ai.usage.output_tokens": usage.completion_tokens})  # fmt: skip
    span.end(end_time=end_ns)


def record_prefill(
    parent: Context,
    request: pb.PrefillRequest,
    response: pb.PrefillResponse,
    info: pb.WorkerInfo,
    end_ns: int | None = None,
) -> None:
    """The spans of a finished Prefill on a prefill worker: queue, prefill, kv_transfer."""
    if _tracer is None:
        return
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    end_ns = time.time_ns() if end_ns is None else end_ns
    # prefill_s runs from arrival to the last computed block; the transfer follows it.
    arrival_ns = end_ns - round((response.prefill_s + response.transfer_s) * _NS_PER_S)
    scheduled_ns = arrival_ns + round(response.queued_s * _NS_PER_S)
    computed_ns = arrival_ns + round(response.prefill_s * _NS_PER_S)
    span = _tracer.start_span(
        "kvflow.worker.prefill",
        context=parent,
        kind=SpanKind.SERVER,
        start_time=arrival_ns,
        attributes={
            "kvflow.worker_request_id": request.request_id,
            "kvflow.tenant": request_context(request).tenant,
            "kvflow.worker.role": Role.from_pb(info.role).value,
            "gen_ai.request.model": info.model,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "kvflow.usage.cached_tokens": response.num_cached_tokens,
            "kvflow.kv_transfer.bytes": response.num_sent_bytes,
            "kvflow.kv_transfer.blocks": response.num_sent_blocks,
        },
    )
    inside = trace.set_span_in_context(span)
    _child("kvflow.queue", inside, arrival_ns, scheduled_ns)
    _child("kvflow.prefill", inside, scheduled_ns, computed_ns,
           **{"kvflow.usage.computed_tokens": response.num_computed_tokens})  # fmt: skip
    _child("kvflow.kv_transfer", inside, computed_ns, end_ns,
           **{"kvflow.kv_transfer.bytes": response.num_sent_bytes})  # fmt: skip
    span.end(end_time=end_ns)
