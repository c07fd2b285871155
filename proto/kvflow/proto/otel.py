"""OpenTelemetry settings every kvflow process reads alike (docs/observability.md, "Traces").

The gateway and the workers both take `--otlp-traces-endpoint` and
`--otlp-traces-sample-ratio`, falling back to OTel's standard variables; the operator
writes those variables into their containers. One reading of them, here, so the two
cannot drift. The SDK is imported only by `tracer_provider`, so a process with tracing off
never loads it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider


class TracingConfigError(ValueError):
    pass


@dataclass(frozen=True)
class TracingConfig:
    endpoint: str | None = None  # None: tracing off
    sample_ratio: float = 1.0


def tracing_config(
    endpoint: str | None, sample_ratio: float | None, env: Mapping[str, str] = os.environ
) -> TracingConfig:
    """Flags first, then OTel's standard environment variables (what OTel users expect).

    Raises TracingConfigError (a ValueError) for a ratio outside [0, 1] or not a number.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig()
    endpoint = (
        endpoint
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or None
    )
    if sample_ratio is None:
        text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            sample_ratio = float(text) if text else 1.0
        except ValueError:
            raise TracingConfigError(
                f"OTEL_TRACES_SAMPLER_ARG={text!r} is not a number; give a ratio in [0, 1]"
            ) from None
    if not 0.0 <= sample_ratio <= 1.0:
        raise TracingConfigError(f"the trace sample ratio {sample_ratio:g} is not in [0, 1]")
    return TracingConfig(endpoint, sample_ratio)


def tracer_provider(config: TracingConfig, service_name: str) -> TracerProvider:
    """A provider that samples parent-based at the config's ratio and batches spans to its
    OTLP/gRPC endpoint. It flushes at exit (it registers its own shutdown)."""
    assert config.endpoint is not None, "tracing is off: there is no endpoint"
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=config.endpoint)))
    return provider
