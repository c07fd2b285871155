"""`kvflow router`: the OpenAI-compatible gateway in front of kvflow workers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import getpass
import logging
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import uvloop

from kvflow.proto import otel
from kvflow.proto.cli_args import port_number, seconds
from kvflow.router import tracing
from kvflow.router.api.response_store_config import (
    add_response_store_flags,
    response_store_config,
)
from kvflow.router.batch.config import add_batch_flags, batch_config
from kvflow.router.caches.config import parse_response_cache, response_cache_flags
from kvflow.router.cli_breaker import breaker_flags, parse_breaker
from kvflow.router.cli_limits import parse_request_limits, request_limit_flags
from kvflow.router.cli_rate_limits import apply_rate_limit_flags, rate_limit_flags
from kvflow.router.cli_security import (
    security_flags,
    security_settings,
    unauthenticated_problem,
)
from kvflow.router.routing.pipeline import RoutingConfigError
from kvflow.router.serving.admission import (
    ADMISSION_FLAGS,
    AdmissionConfig,
    AdmissionConfigError,
    removed_env_problem,
)
from kvflow.router.settings import ConfigError, RouterSettings, load_config
from kvflow.router.tenants.config import TenantConfigError, hash_api_key, hmac_api_key
from kvflow.router.tenants.source import KEY_SECRET_ENV, key_secret_from_env
from kvflow.router.text.tokenizer import TokenizerLoadError
from kvflow.router.workers.deadlines import StreamDeadlines
from kvflow.router.workers.discovery import DiscoveryConfigError, parse_worker_list

READY_PREFIX = "KVFLOW_ROUTER_READY"
# After the drain, or on a second signal: how long open connections get to close.
FINAL_CLOSE_S = 2


def _parser() -> argparse.ArgumentParser:
    d = RouterSettings()
    p = argparse.ArgumentParser(
        prog="kvflow router",
        description="OpenAI-compatible gateway: tenants, quotas, KV-aware routing to workers.",
    )
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=port_number, default=d.port, help="HTTP port (0: any free port)")
    p.add_argument(
        "--model",
        help="tokenizer and chat template: a Hugging Face folder or a .gguf file "
        "(default: the built-in SmolLM2-135M-Instruct GGUF)",
    )
    p.add_argument(
        "--served-model-name",
        help="the model name clients use (default: the name the workers report)",
    )
    workers = p.add_mutually_exclusive_group()
    workers.add_argument("--workers", default="", help="worker gRPC addresses: host:port,...")
    workers.add_argument(
        "--worker-dns",
        help="NAME:PORT of a headless Service; its A records are the workers, re-resolved",
    )
    p.add_argument("--dns-interval-s", type=float, default=d.dns_interval_s)
    p.add_argument(
        "--config",
        help="YAML: routing weights, tenants, public prefixes, limits, disaggregation, "
        "pools and models (several models behind this gateway)",
    )
    p.add_argument(
        "--tenants-file",
        help="YAML list of tenants (the config's tenants section), re-read when it changes: "
        "a mounted Secret on Kubernetes (docs/router.md, Tenants)",
    )
    p.add_argument(
        "--redis-url",
        help="share quotas across router replicas (redis://host:6379/0); default: in-process",
    )
    p.add_argument(
        "--first-token-timeout-s",
        type=seconds(allow_zero=False),
        default=d.deadlines.first_token_s,
        help="an attempt without a first token by then fails over to another worker, which "
        "is then avoided for a while (default: %(default)s)",
    )
    p.add_argument(
        "--token-stall-timeout-s",
        type=seconds(allow_zero=False),
        default=d.deadlines.stall_s,
        help="a stream with no next token for this long ends with an error event and is "
        "aborted on its worker (default: %(default)s)",
    )
    p.add_argument(
        "--drain-grace-s",
        type=seconds(allow_zero=True),
        default=d.drain_grace_s,
        help="after SIGTERM, how long running requests may finish; /ready and new requests "
        "answer 503 meanwhile (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve /metrics on this port (0: any free port) and not on --port, which "
        "tenants reach (default: on --port)",
    )
    _admission_flags(p, d.admission)
    breaker_flags(p, d.breaker)
    _tracing_flags(p)
    request_limit_flags(p, d.request_limits, d.prepare, d.body_timeout_s)
    rate_limit_flags(p)
    add_batch_flags(p)
    add_response_store_flags(p)
    security_flags(p, d)
    response_cache_flags(p, d.response_cache)
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning"])
    p.add_argument(
        "--seed",
        type=int,
        help="seed of routing tie-breaks and of weighted model draws for requests without a "
        "session (default: random)",
    )
    p.add_argument(
        "--hash-api-key",
        action="store_true",
        help="read an API key from stdin, print its api_key_sha256 digest, or with "
        f"{KEY_SECRET_ENV} set its api_key_hmac_sha256 digest, and exit",
    )
    return p


def _admission_flags(p: argparse.ArgumentParser, d: AdmissionConfig) -> None:
    g = p.add_argument_group(
        "admission control",
        "shed load at the gateway from the workers' estimated queue time, before latency "
        "collapses (docs/router.md, Overload)",
    )
    g.add_argument(
        "--admission",
        choices=["on", "off"],
        default="on" if d.is_enabled else "off",
        help="off: admit everything; workers with a bounded queue still refuse (503) "
        "(default: %(default)s)",
    )
    g.add_argument(
        ADMISSION_FLAGS["shed_queue_time_s"],
        type=seconds(allow_zero=False),
        default=d.shed_queue_time_s,
        metavar="S",
        help="past this estimated wait, a tenant over its fair share of the requests in "
        "flight gets 429 with Retry-After (default: %(default)s)",
    )
    g.add_argument(
        ADMISSION_FLAGS["max_queue_time_s"],
        type=seconds(allow_zero=False),
        default=d.max_queue_time_s,
        metavar="S",
        help="past this estimated wait, everyone gets 503 with Retry-After; at least the "
        "shed time (default: %(default)s)",
    )
    g.add_argument(
        ADMISSION_FLAGS["poll_interval_s"],
        type=seconds(allow_zero=False),
        default=d.poll_interval_s,
        metavar="S",
        help="the oldest a worker's queue report may be: the pool polls every worker's load at "
        "the shorter of this and 0.25 s (default: %(default)s)",
    )


def _tracing_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group('tracing (docs/observability.md, "Traces")')
    g.add_argument(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/gRPC here, e.g. http://collector:4317 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT, "
        "else no tracing)",
    )
    g.add_argument(
        "--otlp-traces-sample-ratio",
        type=float,
        metavar="R",
        help="share of new traces kept, 0-1; a caller's sampled traceparent is always "
        "followed (default: $OTEL_TRACES_SAMPLER_ARG, else 1)",
    )


def _refuse_pool_flags(args: argparse.Namespace, config_path: str) -> None:
    """With `pools:` each pool names its model and workers in the config; a flag that
    would name them too is a mistake to point out, not a tie to break."""
    flags = {"--model": args.model, "--served-model-name": args.served_model_name,
             "--workers": args.workers, "--worker-dns": args.worker_dns}  # fmt: skip
    for flag, value in flags.items():
        if value:
            raise ConfigError(
                f"{flag} cannot be combined with the pools section of --config {config_path}: "
                f"each pool names its own model, served name and workers there; drop {flag}"
            )


def parse_args(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> RouterSettings | None:
    """Settings from the command line; None after --hash-api-key did its job."""
    args = _parser().parse_args(list(argv))
    removed = removed_env_problem(env)
    if removed is not None:
        raise ConfigError(removed)
    try:
        admission = AdmissionConfig(
            shed_queue_time_s=args.admission_shed_queue_time_s,
            max_queue_time_s=args.admission_max_queue_time_s,
            poll_interval_s=args.admission_poll_interval_s,
            is_enabled=args.admission == "on",
        )
        traces = otel.tracing_config(args.otlp_traces_endpoint,
                                        args.otlp_traces_sample_ratio, env)  # fmt: skip
    except (AdmissionConfigError, otel.TracingConfigError) as exc:
        raise ConfigError(str(exc)) from exc
    config = load_config(args.config)
    if args.max_body_bytes is not None:
        config = replace(config, max_body_bytes=args.max_body_bytes)
    request_limits, prepare = parse_request_limits(args)
    config = replace(config, rate_limits=apply_rate_limit_flags(args, config.rate_limits))
    if config.pools:
        _refuse_pool_flags(args, args.config)
    if args.hash_api_key:
        key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline()
        secret = key_secret_from_env()
        print(hash_api_key(key.strip()) if secret is None else hmac_api_key(key.strip(), secret))
        return None
    return RouterSettings(
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_name=args.served_model_name,
        workers=tuple(parse_worker_list(args.workers)),
        worker_dns=args.worker_dns,
        dns_interval_s=args.dns_interval_s,
        redis_url=args.redis_url,
        config=config,
        log_level=args.log_level,
        seed=args.seed,
        deadlines=StreamDeadlines(args.first_token_timeout_s, args.token_stall_timeout_s),
        drain_grace_s=args.drain_grace_s,
        tenants_file=Path(args.tenants_file) if args.tenants_file else None,
        metrics_port=args.metrics_port,
        admission=admission,
        tracing=traces,
        request_limits=request_limits,
        prepare=prepare,
        body_timeout_s=args.body_timeout_s,
        response_cache=parse_response_cache(args),
        breaker=parse_breaker(args),
        batch=batch_config(args),
        responses=response_store_config(args),
        **security_settings(args, env),
    )


async def _serve(settings: RouterSettings) -> None:
    import uvicorn

    from kvflow.router.api.app import create_app
    from kvflow.router.api.drain import DrainState
    from kvflow.router.api.gateway import build_gateway
    from kvflow.router.api.http_limits import limited_protocol
    from kvflow.router.api.server import DrainingServer

    gateway = build_gateway(settings)
    drain = DrainState(settings.drain_grace_s)
    # Everything loaded so far (tokenizer tables, templates, the app) lives as long as the
    # process: freezing it keeps the garbage collector from re-scanning it on every full
    # collection, which shows up as tail latency under load.
    gc.collect()
    gc.freeze()
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this. Without it a response written as headers, then
    # body, waits for the client's delayed ACK of the headers: 40 ms on Linux.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((settings.host, settings.port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(gateway, drain),
        log_level=settings.log_level,
        access_log=False,  # one log line per request costs more than routing it
        # The drain has already waited for running requests (api/server.py); this is for
        # the last bytes of responses, and for a stop forced by a second signal.
        timeout_graceful_shutdown=FINAL_CLOSE_S,
        loop="uvloop",
        http=limited_protocol(
            settings.http, gateway.metrics.http_refusals_for, settings.body_timeout_s
        ),
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
        # X-Forwarded-For is judged by the app, against --trusted-proxy-cidrs (limits/
        # client_ip.py); uvicorn's own would believe it from any loopback peer.
        proxy_headers=False,
    )
    if settings.tls_cert_file is not None:
        try:
            config.load()  # builds the TLS context: a bad file is a clear error, not a bind one
        except OSError as exc:  # ssl.SSLError is one
            raise ConfigError(f"cannot use --tls-cert-file/--tls-key-file: {exc}") from exc
    metrics_field = ""
    if settings.metrics_port is not None:
        # prometheus_client's own small HTTP server, on a thread: scrapes never queue
        # behind API requests, and the API's port has no /metrics for tenants to read.
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(
            settings.metrics_port, addr=settings.host, registry=gateway.metrics.registry
        )
        metrics_field = f" metrics_port={metrics_server.server_port}"
    server = DrainingServer(config, drain)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        # One machine-readable line for whoever started us with --port 0 (tests, kvflow up).
        print(f"{READY_PREFIX} port={port}{metrics_field}", flush=True)
    await serving


def main(argv: Sequence[str]) -> int:
    try:
        settings = parse_args(argv)
    except (ConfigError, TenantConfigError, DiscoveryConfigError) as exc:
        print(f"kvflow router: {exc}", file=sys.stderr)
        return 2
    if settings is None:
        return 0
    problem = unauthenticated_problem(settings)
    if problem is not None:
        print(f"kvflow router: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    tracing.configure(settings.tracing)
    try:
        # uvloop: the same event loop uvicorn.run would pick (we run the server ourselves to
        # bind the socket first); about 2x cheaper per request than asyncio's own loop.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_serve(settings))
    except (
        TokenizerLoadError, ConfigError, TenantConfigError, RoutingConfigError,
        DiscoveryConfigError,
    ) as exc:  # fmt: skip
        print(f"kvflow router: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvflow router: {exc}; pick another --port", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0
