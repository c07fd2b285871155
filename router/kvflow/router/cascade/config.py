"""The `cascade:` section: per public model name, a small and a large model and the checks
that send the small model's answer up to the large one (pure). Off for every model it does
not name.

```yaml
cascade:
  chat:                               # a public model name; its aliases share the cascade
    small: chat-small                 # answers first: a public name this gateway serves
    large: chat-large                 # answers when a check fails: another such name
    checks:
      min_mean_logprob: -1.5          # escalate below this mean token logprob; unset: off
      json_when_response_format: true # escalate invalid JSON under a json response_format
      refusal_patterns:               # escalate a choice whose text matches one (re.search)
        - "(?i)\\bI can(no|')t help\\b"
```

The name itself stays a served model with its own targets: a tenant not allowed both the
small and the large model is answered by them, without a cascade (never a forbidden model).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.router.config_fields import ConfigError, check_keys
from kvflow.router.models.routes import ModelRoutes

_KEYS = {"small", "large", "checks"}
_CHECK_KEYS = {"min_mean_logprob", "json_when_response_format", "refusal_patterns"}
# A refusal pattern runs on every small answer, on the event loop: keep them few and short.
MAX_REFUSAL_PATTERNS = 32
MAX_REFUSAL_PATTERN_CHARS = 512


@dataclass(frozen=True)
class CascadeChecks:
    """What a small answer must pass to be sent as it is."""

    min_mean_logprob: float | None = None  # None: the logprob check is off
    json_when_response_format: bool = True
    refusal_patterns: tuple[re.Pattern[str], ...] = ()


@dataclass(frozen=True)
class CascadeSpec:
    model: str  # the public name it is configured under
    names: frozenset[str]  # every name a request may send for it (the name, its aliases)
    small: str
    large: str
    checks: CascadeChecks = CascadeChecks()


def _target(raw: Mapping[str, Any], key: str, where: str, names: frozenset[str],
            public: Collection[str]) -> str:  # fmt: skip
    value = raw.get(key)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}.{key} is required: a model name this gateway serves")
    if value in names:
        raise ConfigError(f"{where}.{key} {value!r} is the cascade's own name; name another "
                          "model this gateway serves")  # fmt: skip
    if value not in public:
        raise ConfigError(
            f"{where}.{key} {value!r} is not a model this gateway serves; known: "
            f"{sorted(public)} (a `models:` entry's name or alias, or a pool's served_model_name)"
        )
    return value


def _patterns(raw: object, where: str) -> tuple[re.Pattern[str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_REFUSAL_PATTERNS:
        raise ConfigError(f"{where} must be a list of at most {MAX_REFUSAL_PATTERNS} regexes")
    patterns = []
    for i, item in enumerate(raw):
        if not isinstance(item, str) or not item or len(item) > MAX_REFUSAL_PATTERN_CHARS:
            raise ConfigError(f"{where}[{i}] must be a regex of 1 to "
                              f"{MAX_REFUSAL_PATTERN_CHARS} characters, got {item!r}")  # fmt: skip
        try:
            patterns.append(re.compile(item))
        except re.error as exc:
            raise ConfigError(f"{where}[{i}] {item!r} is not a valid regex: {exc}") from None
    return tuple(patterns)


def _checks(raw: object, where: str) -> CascadeChecks:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with {', '.join(sorted(_CHECK_KEYS))}")
    check_keys(raw, _CHECK_KEYS, where)
    threshold = raw.get("min_mean_logprob")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int | float)
        or not math.isfinite(threshold) or threshold > 0
    ):  # fmt: skip
        raise ConfigError(f"{where}.min_mean_logprob must be a number <= 0 (a logprob), "
                          f"got {threshold!r}")  # fmt: skip
    json_check = raw.get("json_when_response_format", True)
    if not isinstance(json_check, bool):
        raise ConfigError(f"{where}.json_when_response_format must be true or false")
    return CascadeChecks(
        min_mean_logprob=None if threshold is None else float(threshold),
        json_when_response_format=json_check,
        refusal_patterns=_patterns(raw.get("refusal_patterns"), f"{where}.refusal_patterns"),
    )


def _names(model: str, routes: ModelRoutes) -> frozenset[str]:
    for entry in routes.entries:
        if model == entry.name or model in entry.aliases:
            return frozenset((entry.name, *entry.aliases))
    return frozenset((model,))


def parse_cascade(
    raw: object, routes: ModelRoutes, pool_served_names: Collection[str] | None
) -> dict[str, CascadeSpec]:
    """The section, by configured model name. ``pool_served_names``: the pools' configured
    served names (None: one pool from the command line, one model: nothing to cascade to)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("cascade must be a mapping of model name -> {small, large, checks}")
    if raw and pool_served_names is None:
        raise ConfigError(
            "cascade needs a pools section: a gateway with one pool serves one model, so "
            "there is no small and large model to cascade between"
        )
    public = set(routes.public_names({})) | set(pool_served_names or ())
    specs: dict[str, CascadeSpec] = {}
    claimed: dict[str, str] = {}
    for model, item in raw.items():
        where = f"cascade.{model}"
        if not isinstance(model, str) or not model:
            raise ConfigError(f"cascade keys must be model names, got {model!r}")
        if model not in public:
            raise ConfigError(
                f"{where}: {model!r} is not a model this gateway serves; known: {sorted(public)}"
            )
        if not isinstance(item, dict):
            raise ConfigError(f"{where} must be a mapping with small, large and checks")
        check_keys(item, _KEYS, where)
        names = _names(model, routes)
        small = _target(item, "small", where, names, public)
        large = _target(item, "large", where, names, public)
        if small == large:
            raise ConfigError(f"{where}: small and large are both {small!r}; name two models")
        for name in names:
            if name in claimed:
                raise ConfigError(f"{where}: {name!r} already has a cascade under "
                                  f"cascade.{claimed[name]}")  # fmt: skip
            claimed[name] = model
        checks = _checks(item.get("checks"), f"{where}.checks")
        specs[model] = CascadeSpec(model, names, small, large, checks)
    return specs
