"""The worker's listening ports, shared by the generating worker (app.py) and the embedding
worker (embed/app.py): the gRPC server (the token check, TLS) and the HTTP port of
/metrics, /health and /ready, each bound with a failure that names its flag."""

from __future__ import annotations

import logging
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import TypeVar

import grpc
from prometheus_client import CollectorRegistry

from kvflow.engine_worker.auth import TOKEN_ENV, TokenInterceptor, token_from_env
from kvflow.engine_worker.http_server import start_http_server
from kvflow.engine_worker.settings import WorkerSettings

log = logging.getLogger("kvflow.worker")

T = TypeVar("T")


class PortTakenError(OSError):
    """A port the worker binds is taken; the message names it and its flag."""


def binding(what: str, flag: str, port: int, bind: Callable[[], T]) -> T:
    """``bind()``, with a failure that says which of the worker's three ports clashed (two
    workers on one machine share the default --kv-port as easily as the gRPC port)."""
    try:
        return bind()
    except (OSError, RuntimeError) as exc:  # grpc's add_*_port raises RuntimeError
        raise PortTakenError(
            f"cannot bind the {what} port {port} ({flag}): {exc}; another process holds it. "
            f"Pick a free one with {flag} (0: any free port)"
        ) from exc


def grpc_server() -> grpc.aio.Server:
    """The worker's gRPC server, checking callers' token when the environment sets one."""
    token = token_from_env()
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(token)] if token else [],
        # gRPC binds with SO_REUSEPORT by default: a second worker on a taken --port would
        # start and share it, and callers would reach either one.
        options=[("grpc.so_reuseport", 0)],
    )
    if token is None:
        log.warning("worker gRPC is open to any caller: set %s to require a token", TOKEN_ENV)
    return server


def bind_grpc(server: grpc.aio.Server, settings: WorkerSettings) -> int:
    """Bind --host:--port, over TLS when --tls-cert-file is given; returns the port bound."""
    address = f"{settings.host}:{settings.port}"
    if settings.tls.is_on:
        credentials = settings.tls.server_credentials()
        return binding(
            "gRPC", "--port", settings.port, lambda: server.add_secure_port(address, credentials)
        )
    return binding("gRPC", "--port", settings.port, lambda: server.add_insecure_port(address))


def bind_http(
    settings: WorkerSettings,
    registry: CollectorRegistry,
    is_ready: Callable[[], bool],
    health_problem: Callable[[], str | None] = lambda: None,
) -> ThreadingHTTPServer:
    """Serve /metrics, /health and /ready on --host:--metrics-port (http_server.py)."""
    return binding(
        "metrics",
        "--metrics-port",
        settings.metrics_port,
        lambda: start_http_server(
            settings.host, settings.metrics_port, registry, is_ready, health_problem
        ),
    )
