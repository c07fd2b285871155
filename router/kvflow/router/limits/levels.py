"""What each level may hold, and the config section that says so. Pure.

Three levels beside the tenant's quotas: one served model (all tenants together), one
client IP address (whoever sends from it), and the whole gateway (every replica sharing
one Redis). Each has the same three limits, any of which may be left out (unlimited).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.router.config_fields import ConfigError, check_keys, section

# The order levels are checked in, narrowest first: a client over its own limit is told
# so, rather than that the model or the gateway is full (the tenant's come before all).
LEVELS = ("client_ip", "model", "global")
KINDS = ("requests_per_minute", "tokens_per_minute", "max_in_flight")
# A lease outlives a replica that died holding it by at most this (docs/router.md).
DEFAULT_LEASE_TTL_S = 60.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class LevelLimits:
    """One level's limits; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    max_in_flight: int | None = None  # requests admitted and not yet finished

    @property
    def is_limited(self) -> bool:
        return any(getattr(self, kind) is not None for kind in KINDS)


NO_LIMITS = LevelLimits()


@dataclass(frozen=True)
class Slot:
    """The counters of one level a request draws on: (level, key) with its limits."""

    level: str  # one of LEVELS
    key: str  # the client's address, the served model name, "" for global
    limits: LevelLimits

    def limit_name(self, kind: str) -> str:
        """What a refusal names: ``model/llama/max_in_flight``, ``global/tokens_per_minute``."""
        return "/".join(p for p in (self.level, self.key, kind) if p)


@dataclass(frozen=True)
class LimitsConfig:
    global_limits: LevelLimits = NO_LIMITS
    client_ip: LevelLimits = NO_LIMITS
    models: Mapping[str, LevelLimits] = field(default_factory=dict)  # served name -> limits
    # Peers whose X-Forwarded-For is believed (client_ip.py); (): nobody's.
    trusted_proxies: tuple[Network, ...] = ()
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S

    @property
    def is_limited(self) -> bool:
        return (
            self.global_limits.is_limited
            or self.client_ip.is_limited
            or any(m.is_limited for m in self.models.values())
        )

    def slots(self, client_ip: str | None, model: str) -> tuple[Slot, ...]:
        """The limited levels a request from ``client_ip`` to ``model`` draws on, in the
        order they are checked."""
        slots = []
        if client_ip is not None and self.client_ip.is_limited:
            slots.append(Slot("client_ip", client_ip, self.client_ip))
        model_limits = self.models.get(model, NO_LIMITS)
        if model_limits.is_limited:
            slots.append(Slot("model", model, model_limits))
        if self.global_limits.is_limited:
            slots.append(Slot("global", "", self.global_limits))
        return tuple(slots)


def _count(raw: Mapping[str, Any], name: str, where: str) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}.{name} must be an integer >= 1, got {value!r}")
    return value


def parse_level(raw: Mapping[str, Any], where: str) -> LevelLimits:
    check_keys(raw, set(KINDS), where)
    return LevelLimits(*(_count(raw, kind, where) for kind in KINDS))


def parse_cidrs(values: Sequence[object], where: str) -> tuple[Network, ...]:
    """CIDRs as written (``10.0.0.0/8``, ``::1/128``; a bare address is one host). Host
    bits set is an error: ``10.0.0.1/8`` is likely a typo for a wider trust than meant."""
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(str(value).strip(), strict=True))
        except ValueError as exc:
            raise ConfigError(f"{where}: {value!r} is not a CIDR ({exc})") from exc
    return tuple(networks)


def parse_limits_config(raw: Mapping[str, Any] | None) -> LimitsConfig:
    """The config file's ``rate_limits`` section:

    ```yaml
    rate_limits:
      global: {requests_per_minute: 6000, tokens_per_minute: 2000000, max_in_flight: 512}
      client_ip: {requests_per_minute: 120, max_in_flight: 8}
      models:                                 # by served model name
        llama: {tokens_per_minute: 500000, max_in_flight: 64}
      trusted_proxy_cidrs: [10.0.0.0/8]      # whose X-Forwarded-For is believed
      lease_ttl_s: 60                         # in-flight slots of a dead replica expire
    ```
    """
    if not raw:
        return LimitsConfig()
    where = "rate_limits"
    check_keys(raw, {"global", "client_ip", "models", "trusted_proxy_cidrs", "lease_ttl_s"}, where)
    models = section(raw, "models", f"{where}.")
    cidrs = raw.get("trusted_proxy_cidrs") or []
    if not isinstance(cidrs, list):
        raise ConfigError(f"{where}.trusted_proxy_cidrs must be a list of CIDRs")
    ttl_s = raw.get("lease_ttl_s", DEFAULT_LEASE_TTL_S)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or ttl_s < 1:
        raise ConfigError(f"{where}.lease_ttl_s must be a number of seconds >= 1, got {ttl_s!r}")
    by_model = {}
    for name, limits in models.items():
        if not isinstance(limits, dict):
            raise ConfigError(f"{where}.models.{name} must be a mapping")
        by_model[str(name)] = parse_level(limits, f"{where}.models.{name}")
    return LimitsConfig(
        global_limits=parse_level(section(raw, "global", f"{where}."), f"{where}.global"),
        client_ip=parse_level(section(raw, "client_ip", f"{where}."), f"{where}.client_ip"),
        models=by_model,
        trusted_proxies=parse_cidrs(cidrs, f"{where}.trusted_proxy_cidrs"),
        lease_ttl_s=float(ttl_s),
    )
