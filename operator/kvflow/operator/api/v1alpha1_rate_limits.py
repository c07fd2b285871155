"""The router's limits per served model, per client IP and for the whole gateway, in the
RouterSpec, version v1alpha1 (docs/router.md, "Limits at four levels"; tenants' own quotas
live in the tenants Secret).

Split from ``v1alpha1_router`` (whose RouterSpec embeds it) to keep each file one concept.
The operator turns the gateway-wide and client-IP limits into the router's flags
(--global-*, --client-ip-*, --trusted-proxy-cidrs, --limit-lease-ttl-s) and the per-model
ones into its config file's ``rate_limits.models`` (builders/router_features.py). Unset:
unlimited, the router's default. Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import CelRule, cel, field

# The router's counters are integers >= 1; a larger limit than these is no limit at all.
MAX_PER_MINUTE = 1_000_000_000_000
MAX_IN_FLIGHT = 1_000_000
MAX_MODELS = 64
MAX_CIDRS = 64
# The router's lease default (kvflow.router.limits.levels.DEFAULT_LEASE_TTL_S).
ROUTER_LEASE_TTL_S = 60.0
_MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


@dataclass(frozen=True)
class LevelLimits:
    """One level's limits; an unset one is unlimited. Past any, a request gets 429 with
    Retry-After and an x-kvflow-limit header naming the limit."""

    requests_per_minute: int | None = field(
        "Requests per minute (a one-minute burst).", None, minimum=1, maximum=MAX_PER_MINUTE
    )
    tokens_per_minute: int | None = field(
        """Prompt plus completion tokens per minute; reserved at admission (the prompt and
        max_tokens), what is not generated is given back.""",
        None,
        minimum=1,
        maximum=MAX_PER_MINUTE,
    )
    max_in_flight: int | None = field(
        "Requests running at once.", None, minimum=1, maximum=MAX_IN_FLIGHT
    )


@dataclass(frozen=True)
class ModelLimits:
    """One public model's limits, over all tenants and clients together."""

    name: str = field(
        """The model name clients send (an InferencePool's servedName, or an
        InferenceModel's modelName or alias on a gateway).""",
        min_length=1,
        max_length=128,
        pattern=_MODEL_NAME_PATTERN,
    )
    requests_per_minute: int | None = field(
        "Requests per minute to this model.", None, minimum=1, maximum=MAX_PER_MINUTE
    )
    tokens_per_minute: int | None = field(
        "Prompt plus completion tokens per minute of this model.",
        None,
        minimum=1,
        maximum=MAX_PER_MINUTE,
    )
    max_in_flight: int | None = field(
        "Requests to this model running at once.", None, minimum=1, maximum=MAX_IN_FLIGHT
    )


@cel(
    CelRule(
        "!has(self.trustedProxyCidrs) || self.trustedProxyCidrs.all(c, isCIDR(c) && "
        "cidr(c).masked() == cidr(c))",
        "router.rateLimits.trustedProxyCidrs must be CIDRs without host bits, such as "
        "10.0.0.0/8 or fd00::/8",
        ".trustedProxyCidrs",
    )
)
@dataclass(frozen=True)
class RateLimitsSpec:
    """Limits beside the tenants' quotas, shared by the router replicas through
    router.redis (each replica counts alone without it). Checked narrowest first: client
    IP, model, then the whole gateway."""

    global_limits: LevelLimits = field(
        "The whole gateway, every replica and model together.", LevelLimits(), json_name="global"
    )
    client_ip: LevelLimits = field(
        """One client address, whoever sends from it: the TCP peer, or behind a trusted
        proxy the right-most X-Forwarded-For address outside trustedProxyCidrs.""",
        LevelLimits(),
    )
    models: list[ModelLimits] = field(
        "Per public model name.", [], max_items=MAX_MODELS, map_keys=("name",)
    )
    trusted_proxy_cidrs: list[str] = field(
        """Networks of the proxies (an ingress controller, a load balancer) whose
        X-Forwarded-For is believed. Empty: the TCP peer is the client.""",
        [],
        max_items=MAX_CIDRS,
        list_set=True,
        item_max_length=43,
    )
    lease_ttl_seconds: float = field(
        """An in-flight slot held in Redis by a router replica that died is freed after
        this; live replicas renew theirs every third of it.""",
        ROUTER_LEASE_TTL_S,
        minimum=1,
        maximum=3600,
    )
