"""`kvflow worker`'s serving flags: where it listens, in which role, over which TLS, how it
stops, what it traces, and what its structured-output formats may hold."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.settings.record import WorkerSettings
from kvflow.proto.cli_args import port_number, seconds
from kvflow.proto.roles import ROLE_WORDS, Role


def add_serving_flags(p: argparse.ArgumentParser, d: WorkerSettings) -> None:
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=port_number, default=d.port, help="gRPC port (0: any free port)")
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=d.metrics_port,
        help="HTTP port for /metrics, /health, /ready",
    )
    p.add_argument(
        "--role",
        type=_role,
        default=d.role,
        metavar="{" + ",".join(ROLE_WORDS) + "}",
        help="colocated: prefill and decode here (the old word `both` still works)",
    )
    p.add_argument(
        "--drain-timeout-s",
        type=seconds(allow_zero=True),
        default=d.drain_timeout_s,
        help="on SIGTERM, how long to let running requests finish",
    )
    p.add_argument(
        "--engine-stall-timeout-s",
        type=seconds(allow_zero=False),
        default=d.engine_stall_timeout_s,
        help="/health (and gRPC Health) fail when the engine thread has stopped or spent "
        "longer than this in one step, so the kubelet restarts a wedged worker",
    )
    p.add_argument("--tls-cert-file", metavar="PEM",
                   help="serve gRPC over TLS with this certificate (chain), PEM")  # fmt: skip
    p.add_argument("--tls-key-file", metavar="PEM", help="the certificate's private key, PEM")
    p.add_argument(
        "--tls-ca-file",
        metavar="PEM",
        help="require callers to present a certificate this CA signed (mutual TLS)",
    )
    p.add_argument(
        "--grammar-cache-mib",
        type=int,
        default=d.grammar_cache_mib,
        help="memory for compiled structured-output formats (JSON schemas, regexes, "
        "grammars), least recently used evicted first; each counts an estimate of its "
        "compiled size (a typical tool's schema ~60-100 KiB)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry spans over OTLP/gRPC here, e.g. http://collector:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else none)",
    )
    p.add_argument(
        "--otlp-traces-sample-ratio",
        type=float,
        metavar="R",
        help="ratio of the parent-based sampler, 0-1 (default: $OTEL_TRACES_SAMPLER_ARG, "
        "else 1); only calls with a trace context are traced, and their decision holds",
    )


def _role(word: str) -> Role:
    try:
        return Role.parse(word)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid role {word!r}: choose one of {', '.join(ROLE_WORDS)}"
        ) from None
