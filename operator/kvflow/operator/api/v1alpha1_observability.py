"""Traces in the InferencePool spec, version v1alpha1 (docs/observability.md, "Traces").

Split from ``v1alpha1`` (whose InferencePoolSpec embeds it) to keep each file one concept.
The operator turns it into OpenTelemetry's standard environment variables on the router
and worker containers (builders/pods.py), which both read. Pure: imports neither kopf nor
kubernetes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import field


@dataclass(frozen=True)
class ObservabilitySpec:
    """OpenTelemetry traces of the pool's requests: gateway request, routing decision,
    worker attempt, and on the worker queue, prefill, KV transfer and decode. Off (no
    tracing work at all) while otlpTracesEndpoint is empty."""

    otlp_traces_endpoint: str = field(
        """An OTLP/gRPC collector the gateways and workers send spans to, e.g.
        http://otel-collector.observability:4317 (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT).
        Empty: no traces.""",
        "",
        max_length=2048,
        pattern=r"^$|^https?://",
    )
    traces_sample_ratio: float = field(
        """Share of requests traced (OTEL_TRACES_SAMPLER_ARG of a parent-based ratio
        sampler): a request that arrives with a sampled W3C traceparent is always traced.""",
        1.0,
        minimum=0,
        maximum=1,
    )
