"""The router's settings: the command line plus the YAML file `--config` names.

```yaml
routing:
  weights: {time_cost: 1.0, session: 0.01}   # block policy: prefix_cache, queue_depth, ...
  session_header: x-session-id
  max_blocks_per_worker: 262144
tenants:
  - name: acme
    api_key_sha256: [<sha256 hex of the key>]   # kvflow router --hash-api-key
    models: [smollm2-135m-instruct]              # or ["*"]
    priority: 0
    requests_per_minute: 600
    tokens_per_minute: 200000
    max_concurrent_requests: 32
    daily_token_budget: 5000000
    default_max_tokens: 512                      # this tenant's, over the model's
    max_tokens_limit: 2048                       # the tighter of this and the model's wins
public_prefixes:
  - system: "You are a helpful assistant."       # a system message, rendered by the template
  - text: "<|im_start|>system\\n..."              # or raw prompt text
limits:
  max_body_bytes: 8388608
  default_max_tokens: 1024                        # when a request has none (cut to the context)
  max_tokens_limit: 4096                          # a request asking for more gets a 400
sampling:
  generation_config: auto                         # the model's own defaults; none: OpenAI's
  defaults: {temperature: 0.7, top_p: 0.95}       # over the model's, where a request has none
disaggregation:                                   # pools with prefill and decode workers
  enabled: true
  min_remote_prefill_tokens: 512                  # ship a prompt only when decode lacks this many
  max_prefill_queue_depth: 8                      # ... and a prefill worker has fewer queued
  transfer_timeout_s: 30.0                        # the longest wait of each handoff step
pools: [...]                                      # several models: models/pools.py
models: [...]                                     # public names -> pools: models/routes.py
degradation: {...}                                # per model, its ladder: degrade/config.py
semantic_cache: {...}                             # near-match answers: caches/semantic_config.py
rate_limits:                                      # model, client IP, global: limits/levels.py
  global: {requests_per_minute: 6000, tokens_per_minute: 2000000, max_in_flight: 512}
  client_ip: {requests_per_minute: 120, max_in_flight: 8}
  models: {smollm2-135m-instruct: {max_in_flight: 64}}
  trusted_proxy_cidrs: [10.0.0.0/8]
cascade: {...}                                    # per model, small then large: cascade/config.py
prices:                                           # per served model, USD per million tokens
  smollm2-135m-instruct: {input_usd_per_million_tokens: 0.15,
                          cached_input_usd_per_million_tokens: 0.075,
                          output_usd_per_million_tokens: 0.6}
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvflow.proto.otel import TracingConfig
from kvflow.router.api.drain import DEFAULT_DRAIN_GRACE_S
from kvflow.router.api.http_limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_SSE_KEEPALIVE_INTERVAL_S,
    HttpLimits,
)
from kvflow.router.api.response_store_config import ResponseStoreConfig
from kvflow.router.batch.config import BatchConfig
from kvflow.router.breaker.machine import BreakerConfig
from kvflow.router.caches.config import ResponseCacheConfig
from kvflow.router.caches.semantic_config import SemanticCacheConfig, parse_semantic_cache
from kvflow.router.cascade.config import CascadeSpec, parse_cascade
from kvflow.router.config_fields import ConfigError as ConfigError  # noqa: PLC0414 re-export
from kvflow.router.config_fields import check_keys, parse_disaggregation, section
from kvflow.router.degrade.config import (
    DegradationSpec,
    check_response_cache,
    parse_degradation,
)
from kvflow.router.limits.levels import LimitsConfig, parse_limits_config
from kvflow.router.models.pools import PoolSpec, parse_pools
from kvflow.router.models.routes import ModelRoutes, parse_models
from kvflow.router.protocol.limits import RequestLimits
from kvflow.router.routing.block_index import DEFAULT_MAX_BLOCKS_PER_WORKER
from kvflow.router.routing.pipeline import (
    BLOCK_SCORERS,
    BLOCK_WEIGHTS,
    DEFAULT_WEIGHTS,
    canonical_weights,
)
from kvflow.router.routing.placement import DisaggregationConfig
from kvflow.router.serving.admission import AdmissionConfig
from kvflow.router.serving.prepare import PrepareConfig
from kvflow.router.tenants.config import (
    MaxTokensLimits,
    TenantDirectory,
    parse_max_tokens_limits,
    parse_tenants,
)
from kvflow.router.tenants.money import ModelPrices, parse_prices
from kvflow.router.tenants.quota_scope import DEFAULT_QUOTA_SCOPE
from kvflow.router.text.generation_config import NO_DEFAULTS, SamplingDefaults
from kvflow.router.workers.deadlines import StreamDeadlines
from kvflow.router.workers.tls import WorkerTls

# 8 MiB: an 8k-token prompt is about 32 KB of text; even a 128k-token context with JSON
# escaping stays under 2 MB, so this refuses only what no model here could read.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_SESSION_HEADER = "x-session-id"


@dataclass(frozen=True)
class PublicPrefixSpec:
    text: str | None = None
    system: str | None = None


@dataclass(frozen=True)
class RouterConfig:
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    session_header: str = DEFAULT_SESSION_HEADER
    max_blocks_per_worker: int = DEFAULT_MAX_BLOCKS_PER_WORKER
    tenants: TenantDirectory = field(default_factory=lambda: parse_tenants(None))
    public_prefixes: tuple[PublicPrefixSpec, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)
    max_tokens: MaxTokensLimits = field(default_factory=MaxTokensLimits)
    # False (`generation_config: none`): ignore the model's generation config.
    use_generation_config: bool = True
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # the operator's, over the model's
    # Several pools behind this gateway (models/pools.py); (): one, from the command line.
    pools: tuple[PoolSpec, ...] = ()
    models: ModelRoutes = field(default_factory=ModelRoutes)  # public names -> pools
    # Served model name -> its prices (tenants/money.py); a model not listed costs nothing.
    prices: Mapping[str, ModelPrices] = field(default_factory=dict)
    # Public model name -> its degradation ladder (degrade/config.py); {}: off for all.
    degradation: Mapping[str, DegradationSpec] = field(default_factory=dict)
    # Limits per served model, client IP and for the whole gateway (limits/levels.py).
    rate_limits: LimitsConfig = field(default_factory=LimitsConfig)
    # Public model name -> its small/large cascade (cascade/config.py); {}: off for all.
    cascade: Mapping[str, CascadeSpec] = field(default_factory=dict)
    # Near-match answers for opted-in models and tenants (caches/semantic_config.py).
    semantic_cache: SemanticCacheConfig = field(default_factory=SemanticCacheConfig)


@dataclass(frozen=True)
class RouterSettings:
    host: str = "0.0.0.0"
    port: int = 8000
    # The one pool's, without `pools:` in the config (which refuses these four).
    model: str | None = None  # tokenizer + chat template; None: the built-in SmolLM2 GGUF
    served_model_name: str | None = None  # None: whatever the workers report
    workers: tuple[str, ...] = ()
    worker_dns: str | None = None  # NAME:PORT of a headless Service
    dns_interval_s: float = 5.0
    redis_url: str | None = None
    config: RouterConfig = field(default_factory=RouterConfig)
    log_level: str = "info"
    seed: int | None = None  # of tie-breaking and sessionless model draws; None: random
    # Each attempt's first-token and token-stall deadlines (workers/deadlines.py).
    deadlines: StreamDeadlines = field(default_factory=StreamDeadlines)
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S  # after SIGTERM, for running requests
    # Tenants from this file instead of the config's section, re-read when it changes.
    tenants_file: Path | None = None
    # Serve /metrics on this port (0: any free one) instead of on the API's, which tenants
    # reach; None: on the API's port, as `kvflow up` does.
    metrics_port: int | None = None
    # Gateway admission control (serving/admission.py): the --admission* flags.
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # OpenTelemetry traces (tracing.py): off unless an OTLP endpoint is given.
    tracing: TracingConfig = field(default_factory=TracingConfig)
    # -- What one request may ask for, and the work before generation ------------------
    # Caps checked while parsing (protocol/limits.py): the --max-* request flags.
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    # Templates, tokenizing, grammar compiles off the event loop (serving/prepare.py).
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    # A request's body must arrive within this of its headers (api/http_limits.py): 408.
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    # --- exposure: the HTTP listener, quota store, disclosure (docs/router.md, "Security") --
    # Connection-level limits of the HTTP listener (api/http_limits.py).
    http: HttpLimits = field(default_factory=HttpLimits)
    # Between two SSE events, a `: keep-alive` comment after this long; 0: none.
    sse_keepalive_interval_s: float = DEFAULT_SSE_KEEPALIVE_INTERVAL_S
    # TLS on the gateway's own listener; both or neither.
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # Without tenants, serve anonymous callers (as admins) on a non-loopback address too.
    allow_unauthenticated: bool = False
    # Namespaces the quota keys in a shared Redis (a namespace/pool or gateway name).
    quota_scope: str = DEFAULT_QUOTA_SCOPE
    # When Redis fails: "memory" (limits per replica) or "deny" (503 with Retry-After).
    quota_on_store_failure: str = "memory"
    # The secret default cache salts are derived with (tenants/salts.py); None: random.
    cache_salt_secret: bytes | None = None
    # Worker gRPC over (mutual) TLS (workers/tls.py); off: plaintext.
    worker_tls: WorkerTls = field(default_factory=WorkerTls)
    # Answers of repeated deterministic requests (caches/): the --response-cache* flags.
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)
    # Circuit breakers per worker and per pool (kvflow.router.breaker): the --breaker* flags.
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # The Batch API: its store, limits, pace and price (batch/config.py).
    batch: BatchConfig = field(default_factory=BatchConfig)
    responses: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)

    def __post_init__(self) -> None:
        # The config's ladders and the flags' cache meet here (degrade/config.py).
        check_response_cache(self.config.degradation, self.response_cache.is_enabled)


def parse_config(raw: object) -> RouterConfig:
    if raw is None:
        return RouterConfig()
    if not isinstance(raw, dict):
        raise ConfigError("the configuration must be a YAML mapping")
    check_keys(
        raw,
        {
            "routing",
            "tenants",
            "public_prefixes",
            "limits",
            "sampling",
            "disaggregation",
            "pools",
            "models",
            "prices",
            "degradation",
            "rate_limits",
            "cascade",
            "semantic_cache",
        },
        "the configuration",
    )
    routing = section(raw, "routing")
    check_keys(routing, {"weights", "session_header", "max_blocks_per_worker"}, "routing")
    # Earlier scorer names (prefix_blocks, kv_usage) read as the scorers' names.
    configured = canonical_weights(section(routing, "weights"))
    # Weights naming the block policy's scorers (blocks, requests, a fraction) and not the
    # time scorer, or it at 0 (as a CRD may set it), extend that policy: its units do not
    # mix with seconds.
    is_timed = configured.get("time_cost", 0) != 0
    is_block_policy = not is_timed and bool(set(configured) & BLOCK_SCORERS)
    weights = dict(BLOCK_WEIGHTS if is_block_policy else DEFAULT_WEIGHTS)
    weights.update(configured)
    limits = section(raw, "limits")
    check_keys(limits, {"max_body_bytes", "default_max_tokens", "max_tokens_limit"}, "limits")
    prefixes = []
    for i, item in enumerate(raw.get("public_prefixes") or []):
        if (
            not isinstance(item, dict)
            or len(item) != 1
            or not isinstance(next(iter(item.values())), str)
        ):
            raise ConfigError(f"public_prefixes[{i}] must be {{text: ...}} or {{system: ...}}")
        check_keys(item, {"text", "system"}, f"public_prefixes[{i}]")
        prefixes.append(PublicPrefixSpec(text=item.get("text"), system=item.get("system")))
    max_blocks = routing.get("max_blocks_per_worker", DEFAULT_MAX_BLOCKS_PER_WORKER)
    max_body = limits.get("max_body_bytes", DEFAULT_MAX_BODY_BYTES)
    for name, value in (("routing.max_blocks_per_worker", max_blocks),
                        ("limits.max_body_bytes", max_body)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    tenants = raw.get("tenants")
    if tenants is not None and not isinstance(tenants, list):
        raise ConfigError("tenants must be a list")
    disaggregation = parse_disaggregation(section(raw, "disaggregation"))
    pools = parse_pools(raw.get("pools"), disaggregation)
    if raw.get("models") is not None and not pools:
        raise ConfigError("models routes public names to pools: it needs a pools section")
    models = parse_models(raw.get("models"), [p.name for p in pools])
    served_names = [p.served_model_name for p in pools if p.served_model_name] if pools else None
    degradation = parse_degradation(raw.get("degradation"), models, served_names)
    cascade = parse_cascade(raw.get("cascade"), models, served_names)
    public = None if served_names is None else {*models.public_names({}), *served_names}
    targets = (n for c in cascade.values() for n in (c.small, c.large))
    generating = {*degradation, *cascade, *targets}
    return RouterConfig(
        weights=weights,
        session_header=str(routing.get("session_header", DEFAULT_SESSION_HEADER)).lower(),
        max_blocks_per_worker=max_blocks,
        tenants=parse_tenants(tenants),
        public_prefixes=tuple(prefixes),
        max_body_bytes=max_body,
        disaggregation=disaggregation,
        max_tokens=parse_max_tokens_limits(limits, "limits", ConfigError),
        **_sampling(section(raw, "sampling")),
        pools=pools,
        models=models,
        prices=parse_prices(raw.get("prices"), ConfigError),
        degradation=degradation,
        rate_limits=parse_limits_config(section(raw, "rate_limits")),
        cascade=cascade,
        semantic_cache=parse_semantic_cache(raw.get("semantic_cache"), public, generating),
    )


# The ranges a request may ask for (protocol/requests.py).
_SAMPLING_RANGES = {"temperature": (0, 2), "top_p": (0, 1), "top_k": (0, 2**31 - 1),
                    "min_p": (0, 1), "repetition_penalty": (1e-9, 1e9)}  # fmt: skip


def _float_or_none(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _sampling(raw: Mapping[str, Any]) -> dict[str, Any]:
    check_keys(raw, {"generation_config", "defaults"}, "sampling")
    source = raw.get("generation_config", "auto")
    if source not in ("auto", "none"):
        raise ConfigError(f"sampling.generation_config must be auto or none, got {source!r}")
    defaults = section(raw, "defaults")
    check_keys(defaults, set(_SAMPLING_RANGES), "sampling.defaults")
    for name, value in defaults.items():
        low, high = _SAMPLING_RANGES[name]
        is_number = not isinstance(value, bool) and isinstance(value, int | float)
        if not is_number or not low <= value <= high or (name == "top_k" and value != int(value)):
            raise ConfigError(
                f"sampling.defaults.{name} must be a number in [{low}, {high}], got {value!r}"
            )
        if name == "top_p" and value == 0:  # keeps no token: every request would be refused
            raise ConfigError("sampling.defaults.top_p must be in (0, 1], got 0")
    return {
        "use_generation_config": source == "auto",
        "sampling_defaults": SamplingDefaults(
            temperature=_float_or_none(defaults.get("temperature")),
            top_p=_float_or_none(defaults.get("top_p")),
            top_k=None if defaults.get("top_k") is None else int(defaults["top_k"]),
            min_p=_float_or_none(defaults.get("min_p")),
            repetition_penalty=_float_or_none(defaults.get("repetition_penalty")),
        ),
    }


def load_config(path: str | Path | None) -> RouterConfig:
    if path is None:
        return RouterConfig()
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read --config {path}: {exc}") from exc
    return parse_config(raw)
