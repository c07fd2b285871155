"""The router's limits, circuit breaker and Batch API from a RouterSpec (pure).

Flags where the router has them (its CLI contract: kvflow.router.cli_rate_limits,
cli_breaker, batch.config), the per-model limits in its config file (it has no flag for
them). A setting equal to the router's default renders no flag, so a pool that sets none
of these keeps the command line it had. tests/operator/test_router_features.py parses
what these render with the router's own parser.
"""

from __future__ import annotations

from kvflow.operator.api import v1alpha1_batch as batch_api
from kvflow.operator.api import v1alpha1_breaker as breaker_api
from kvflow.operator.api import v1alpha1_rate_limits as limits_api
from kvflow.operator.api.schema import Json

BATCH_MOUNT = "/var/lib/kvflow/batch"
BATCH_VOLUME = "batch"

_KINDS = ("requests_per_minute", "tokens_per_minute", "max_in_flight")


def _number(value: float) -> str:
    """A flag value the router's int and float parsers both read as given (30.0 -> 30)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def rate_limit_args(limits: limits_api.RateLimitsSpec) -> list[str]:
    """--global-*, --client-ip-*, --trusted-proxy-cidrs and --limit-lease-ttl-s."""
    args: list[str] = []
    for prefix, level in (("--global", limits.global_limits), ("--client-ip", limits.client_ip)):
        for kind in _KINDS:
            value = getattr(level, kind)
            if value is not None:
                args += [f"{prefix}-{kind.replace('_', '-')}", str(value)]
    if limits.trusted_proxy_cidrs:
        args += ["--trusted-proxy-cidrs", ",".join(limits.trusted_proxy_cidrs)]
    if limits.lease_ttl_seconds != limits_api.ROUTER_LEASE_TTL_S:
        args += ["--limit-lease-ttl-s", _number(limits.lease_ttl_seconds)]
    return args


def rate_limits_section(limits: limits_api.RateLimitsSpec) -> dict[str, Json] | None:
    """The router config's `rate_limits:` section (the per-model limits); None: none."""
    models: dict[str, Json] = {}
    for model in limits.models:
        entry = {k: getattr(model, k) for k in _KINDS if getattr(model, k) is not None}
        if entry:
            models[model.name] = entry
    return {"models": models} if models else None


def breaker_args(breaker: breaker_api.CircuitBreakerSpec) -> list[str]:
    """The --breaker* flags that differ from the router's defaults."""
    if not breaker.enabled:
        return ["--breaker", "off"]
    args: list[str] = []
    for flag, value, default in (
        ("--breaker-error-rate", breaker.error_rate_threshold, breaker_api.ROUTER_ERROR_RATE),
        ("--breaker-window-s", breaker.window_seconds, breaker_api.ROUTER_WINDOW_S),
        ("--breaker-min-requests", breaker.min_requests, breaker_api.ROUTER_MIN_REQUESTS),
        ("--breaker-open-s", breaker.open_seconds, breaker_api.ROUTER_OPEN_S),
        ("--breaker-max-open-s", breaker.max_open_seconds, breaker_api.ROUTER_MAX_OPEN_S),
        ("--breaker-half-open-probes", breaker.half_open_probes,
         breaker_api.ROUTER_HALF_OPEN_PROBES),
    ):  # fmt: skip
        if value != default:
            args += [flag, _number(value)]
    return args


def batch_args(
    batch: batch_api.BatchSpec, *, has_redis: bool, slo_tpot_target_ms: int | None
) -> list[str]:
    """--batch-dir on the mounted claim (storage Volume) and the limits that differ from
    the router's defaults. Storage Redis needs no flag: the router uses its --redis-url.
    Where the Batch API is on, batch requests are paced by the online TPOT target: the
    spec's, else the pool's SLO (``slo_tpot_target_ms``; None for a gateway's router)."""
    args: list[str] = []
    is_on = batch.storage == "Volume" or has_redis
    target_ms = batch.online_tpot_target_ms or slo_tpot_target_ms
    if is_on and target_ms is not None:
        args += ["--batch-online-tpot-target-s", _number(target_ms / 1000)]
        if batch.tpot_headroom_fraction != batch_api.ROUTER_TPOT_HEADROOM_FRACTION:
            args += ["--batch-tpot-headroom-fraction", _number(batch.tpot_headroom_fraction)]
    if batch.storage == "Volume":
        args += ["--batch-dir", BATCH_MOUNT]
    for flag, value, default in (
        ("--batch-max-file-bytes", batch.max_file_bytes, batch_api.ROUTER_MAX_FILE_BYTES),
        ("--batch-max-lines", batch.max_lines, batch_api.ROUTER_MAX_LINES),
        ("--batch-max-in-flight", batch.max_in_flight, batch_api.ROUTER_MAX_IN_FLIGHT),
        ("--batch-completion-window-s", batch.completion_window_seconds,
         batch_api.ROUTER_COMPLETION_WINDOW_S),
    ):  # fmt: skip
        if value != default:
            args += [flag, _number(value)]
    if batch.price_factor != batch_api.ROUTER_PRICE_FACTOR:
        args += ["--batch-price-factor", batch.price_factor]
    return args


def batch_volume(batch: batch_api.BatchSpec) -> tuple[dict[str, Json], dict[str, Json]] | None:
    """The claim the router writes batches to (storage Volume), and its mount."""
    claim = batch.persistent_volume_claim
    if batch.storage != "Volume" or claim is None:
        return None
    return (
        {"name": BATCH_VOLUME, "persistentVolumeClaim": {"claimName": claim.claim_name}},
        {"name": BATCH_VOLUME, "mountPath": BATCH_MOUNT},
    )
