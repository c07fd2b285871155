"""Tenants as configured: who a key belongs to, what it may use, and its limits. Pure.

API keys are never stored, only a digest: ``api_key_sha256`` (SHA-256 of the key; the
`kvflow router --hash-api-key` helper makes it) or ``api_key_hmac_sha256`` (HMAC-SHA256
under a server-side secret, ``KVFLOW_TENANT_KEY_SECRET``). Keys are long random strings, so
a fast hash is enough, and a leaked config file or Redis dump reveals no usable key; with
the HMAC form a leaked tenants file does not even allow guessing weak keys offline without
the server's secret. A dict lookup on the digest needs no constant-time compare: the time
it takes depends on the digest, which the caller cannot steer bit by bit (that is what a
constant-time compare of the key itself would protect).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvflow.proto.priority_class import CLASS_WORDS, PriorityClass
from kvflow.router.tenants.money import DEFAULT_BUDGET_WARNING_FRACTION, Budgets, usd_to_pusd
from kvflow.router.tenants.salts import random_secret, tenant_salt

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class TenantConfigError(ValueError):
    """The tenants section of the configuration is invalid; the message names the field."""


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def hmac_api_key(api_key: str, secret: bytes) -> str:
    """The ``api_key_hmac_sha256`` digest of a key under the server-side secret."""
    return hmac.new(secret, api_key.encode(), hashlib.sha256).hexdigest()


# Default salts are derived under this until a directory is given the configured secret
# (`with_salt_secret`): unguessable either way (tenants/salts.py).
_PROCESS_SALT_SECRET = random_secret()


@dataclass(frozen=True)
class Quotas:
    """Per-tenant limits; None is unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + completion tokens
    max_concurrent_requests: int | None = None
    daily_token_budget: int | None = None  # prompt + completion tokens per UTC day
    # Spend limits in money, per UTC day and per UTC month (tenants/money.py).
    budgets: Budgets = field(default_factory=Budgets)


@dataclass(frozen=True)
class MaxTokensLimits:
    """A default and a cap for a request's ``max_tokens`` (a tenant's, or the gateway's
    `limits` for its model); None: none."""

    default_max_tokens: int | None = None  # for a request that leaves max_tokens out
    max_tokens_limit: int | None = None  # a request asking for more gets a 400


@dataclass(frozen=True)
class Tenant:
    name: str
    models: frozenset[str] | None  # None: every served model
    priority: int  # lower runs first on the workers
    quotas: Quotas
    cache_salt: str
    max_tokens: MaxTokensLimits = MaxTokensLimits()
    # May ask for route explanations (x-kvflow-route: worker addresses, scores).
    is_admin: bool = False
    # The salt is derived from the name under the server's secret (no cache_salt given).
    is_salt_derived: bool = False
    # May its deterministic requests be answered from the response cache (caches/)?
    response_cache: bool = True
    # May its requests be answered by a near match from the semantic cache (caches/semantic*)?
    # Off unless granted: a near-miss answer is a wrong answer for some traffic.
    semantic_cache: bool = False
    # The most urgent priority class its requests may run as; a request asking for more is
    # capped to it (protocol/priority_class.py). Normal by default: realtime work preempts
    # everyone else's on the workers and survives the load that sheds normal requests, so
    # the operator grants it per tenant; a tenant that names no class is served as before.
    max_priority_class: PriorityClass = PriorityClass.NORMAL

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


# With no tenants configured (kvflow up), every caller is this one: no limits, and one
# shared cache, as on a single-user machine.
# It is the one caller there is, so it may see route explanations too. Its priority class
# ceiling is normal, as a tenant's default: a realtime request runs as normal there.
ANONYMOUS = Tenant("anonymous", None, 0, Quotas(), cache_salt="", is_admin=True)


def _positive_int(raw: Mapping[str, Any], key: str, where: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TenantConfigError(f"{where}.{key} must be a positive integer, got {value!r}")
    return value


def _parse_tenant(raw: object, i: int) -> tuple[Tenant, list[str], list[str]]:
    where = f"tenants[{i}]"
    if not isinstance(raw, dict):
        raise TenantConfigError(f"{where} must be a mapping")
    known = {
        "name", "api_key_sha256", "api_key_hmac_sha256", "models", "priority", "cache_salt",
        "requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
        "daily_token_budget", "default_max_tokens", "max_tokens_limit", "admin",
        "daily_budget_usd", "monthly_budget_usd", "budget_warning_fraction",
        "response_cache", "semantic_cache",
        "max_priority_class",
    }  # fmt: skip
    unknown = sorted(set(raw) - known)
    if unknown:
        raise TenantConfigError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
    name = raw.get("name")
    if not isinstance(name, str) or not _TENANT_NAME.match(name):
        raise TenantConfigError(
            f"{where}.name must be 1-63 letters, digits, '.', '_' or '-', got {name!r}"
        )
    hashes = _digests(raw, "api_key_sha256", where)
    macs = _digests(raw, "api_key_hmac_sha256", where)
    if not hashes and not macs:
        raise TenantConfigError(
            f"{where} needs api_key_sha256 or api_key_hmac_sha256: one or more lowercase "
            "SHA-256 hex digests (make one with: kvflow router --hash-api-key)"
        )
    models = raw.get("models")
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) for m in models)
    ):
        raise TenantConfigError(f"{where}.models must be a list of model names")
    priority = raw.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TenantConfigError(f"{where}.priority must be an integer")
    salt = raw.get("cache_salt", tenant_salt(_PROCESS_SALT_SECRET, name))
    if not isinstance(salt, str) or not salt:
        raise TenantConfigError(f"{where}.cache_salt must be a non-empty string")
    quotas = Quotas(
        requests_per_minute=_positive_int(raw, "requests_per_minute", where),
        tokens_per_minute=_positive_int(raw, "tokens_per_minute", where),
        max_concurrent_requests=_positive_int(raw, "max_concurrent_requests", where),
        daily_token_budget=_positive_int(raw, "daily_token_budget", where),
        budgets=_budgets(raw, where),
    )
    max_tokens = parse_max_tokens_limits(raw, where, TenantConfigError)
    models_set = None if models is None or "*" in models else frozenset(models)
    is_admin = raw.get("admin", False)
    if not isinstance(is_admin, bool):
        raise TenantConfigError(f"{where}.admin must be true or false")
    response_cache = raw.get("response_cache", True)
    if not isinstance(response_cache, bool):
        raise TenantConfigError(f"{where}.response_cache must be true or false")
    semantic_cache = raw.get("semantic_cache", False)
    if not isinstance(semantic_cache, bool):
        raise TenantConfigError(f"{where}.semantic_cache must be true or false")
    tenant = Tenant(name, models_set, priority, quotas, salt, max_tokens, is_admin,
                    is_salt_derived="cache_salt" not in raw,
                    response_cache=response_cache, semantic_cache=semantic_cache,
                    max_priority_class=_priority_class(raw, where))  # fmt: skip
    return tenant, hashes, macs


def _priority_class(raw: Mapping[str, Any], where: str) -> PriorityClass:
    value = raw.get("max_priority_class", PriorityClass.NORMAL.value)
    if not isinstance(value, str) or value not in CLASS_WORDS:
        raise TenantConfigError(
            f"{where}.max_priority_class must be one of {', '.join(CLASS_WORDS)}, got {value!r}"
        )
    return PriorityClass(value)


def _budgets(raw: Mapping[str, Any], where: str) -> Budgets:
    limits: list[int | None] = []
    for key in ("daily_budget_usd", "monthly_budget_usd"):
        value = raw.get(key)
        pusd = None if value is None else usd_to_pusd(value, f"{where}.{key}", TenantConfigError)
        if pusd == 0:
            raise TenantConfigError(f"{where}.{key} must be more than 0, got {value!r}")
        limits.append(pusd)
    fraction = raw.get("budget_warning_fraction", DEFAULT_BUDGET_WARNING_FRACTION)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, int | float)
        or not (0 < fraction <= 1)
    ):
        raise TenantConfigError(
            f"{where}.budget_warning_fraction must be a number in (0, 1], got {fraction!r}"
        )
    return Budgets(limits[0], limits[1], float(fraction))


def _digests(raw: Mapping[str, Any], key: str, where: str) -> list[str]:
    digests = raw.get(key, [])
    digests = [digests] if isinstance(digests, str) else digests
    if not isinstance(digests, list) or not all(
        isinstance(h, str) and _SHA256_HEX.match(h) for h in digests
    ):
        raise TenantConfigError(
            f"{where}.{key} must be lowercase SHA-256 hex digests, not the keys themselves "
            "(make one with: kvflow router --hash-api-key)"
        )
    return digests


def parse_max_tokens_limits(
    raw: Mapping[str, Any], where: str, error: type[ValueError]
) -> MaxTokensLimits:
    """``default_max_tokens`` and ``max_tokens_limit`` of a config mapping, checked."""
    values = {}
    for key in ("default_max_tokens", "max_tokens_limit"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value <= 0):  # fmt: skip
            raise error(f"{where}.{key} must be a positive integer, got {value!r}")
        values[key] = value
    limits = MaxTokensLimits(**values)
    if (limits.default_max_tokens or 0) > (limits.max_tokens_limit or 2**63):
        raise error(
            f"{where}.default_max_tokens ({limits.default_max_tokens}) is more than "
            f"{where}.max_tokens_limit ({limits.max_tokens_limit})"
        )
    return limits


@dataclass(frozen=True)
class TenantDirectory:
    tenants: Mapping[str, Tenant]  # by name
    _by_key_hash: Mapping[str, str]
    _by_key_hmac: Mapping[str, str] = field(default_factory=dict)
    key_secret: bytes | None = None  # for api_key_hmac_sha256 digests

    @property
    def is_open(self) -> bool:
        """No tenants configured: every caller is ANONYMOUS."""
        return not self.tenants

    def with_key_secret(self, secret: bytes | None) -> TenantDirectory:
        """This directory checking HMAC digests under ``secret``; a directory that lists
        some and no secret to check them is a configuration error, not a silent 401."""
        if self._by_key_hmac and not secret:
            raise TenantConfigError(
                "tenants list api_key_hmac_sha256 digests: set KVFLOW_TENANT_KEY_SECRET to "
                "the secret they were made with"
            )
        return replace(self, key_secret=secret or None)

    def key_digests(self) -> list[tuple[str, str]]:
        """(digest, tenant name) of every configured key, both kinds."""
        return [*self._by_key_hash.items(), *self._by_key_hmac.items()]

    def with_salt_secret(self, secret: bytes) -> TenantDirectory:
        """This directory with every derived cache salt derived under ``secret``."""
        tenants = {name: replace(t, cache_salt=tenant_salt(secret, name))
                   if t.is_salt_derived else t for name, t in self.tenants.items()}  # fmt: skip
        return replace(self, tenants=tenants)

    def lookup(self, api_key: str) -> Tenant | None:
        name = self._by_key_hash.get(hash_api_key(api_key))
        if name is None and self.key_secret is not None:
            name = self._by_key_hmac.get(hmac_api_key(api_key, self.key_secret))
        return None if name is None else self.tenants[name]


def parse_tenants(raw: Sequence[object] | None) -> TenantDirectory:
    tenants: dict[str, Tenant] = {}
    by_digest: tuple[dict[str, str], dict[str, str]] = ({}, {})
    for i, item in enumerate(raw or []):
        tenant, hashes, macs = _parse_tenant(item, i)
        if tenant.name in tenants:
            raise TenantConfigError(f"tenants[{i}]: the name {tenant.name!r} is used twice")
        tenants[tenant.name] = tenant
        for digests, seen in ((hashes, by_digest[0]), (macs, by_digest[1])):
            for h in digests:
                if h in seen:
                    raise TenantConfigError(f"tenants[{i}]: an API key digest is used twice")
                seen[h] = tenant.name
    return TenantDirectory(tenants, *by_digest)
