"""A real OTLP/gRPC trace receiver for tests: OpenTelemetry's own TraceService, served on a
real gRPC server in the test process, keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]


class _Servicer(tsgrpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(  # noqa: N802
        self, request: tspb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> tspb.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=s.name,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                    ))  # fmt: skip
        with self.receiver.lock:
            self.receiver.spans.extend(received)
        return tspb.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tsgrpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, names: set[str], timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Every span so far, once spans with all of ``names`` have come (or the timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        return self.snapshot()

    def stop(self) -> None:
        self._server.stop(grace=None)
