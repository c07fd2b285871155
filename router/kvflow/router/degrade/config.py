"""The `degradation:` section: per public model name, the ladder it steps down when its SLO
burns (pure). Off for every model it does not name.

```yaml
degradation:
  smollm2:                          # a public model name; its aliases share the ladder
    steps: [cap_max_tokens, drop_extras, fallback_model, queue_with_deadline]
    ttft_slo_s: 1.0                 # the SLO the burn rates are measured against
    tpot_slo_s: 0.1
    slo_percentile: 90              # the budget: 10% of requests may miss a target
    window_s: 30                    # the requests the signals are computed over
    engage_burn: 2.0                # a burn rate over this ... (either target)
    engage_queue_s: 2.0             # ... or a queue P90 over this is hot
    engage_after_s: 10              # hot this long: take the next step
    release_burn: 0.5               # every burn under this and
    release_queue_s: 0.5            # queue P90 under this is calm
    release_after_s: 30             # calm this long: revert the last step taken
    reengage_window_s: 120          # a step engaged again this soon after its release ...
    max_release_after_s: 480        # ... doubles its next release dwell, up to this
    release_offered_ratio: 0        # > 0: release once arrivals/s < this x those at the step's
                                    # engage (or after max_release_after_s calm); 0: off (default)
    min_requests: 5                 # fewer in the window: hold (too few to judge)
    check_interval_s: 1.0           # how often the ladder looks at the window
    max_tokens_cap: 256             # cap_max_tokens: generate at most this many per choice
    fallback_model: smollm2-small   # fallback_model: another public name this gateway serves
    queue_deadline_s: 10            # queue_with_deadline: wait this long for capacity
```

A step's field is required when the step is listed. `response_cache` (a sampled request
answered with its greedy twin's stored answer: caches/policy.py) needs the response cache
on (`--response-cache on`): the settings refuse it otherwise (`check_response_cache`), as a
ladder that names it would take a step that does nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow.router.config_fields import ConfigError, check_keys
from kvflow.router.degrade.ladder import LadderConfig, Step
from kvflow.router.degrade.signals import SloTargets
from kvflow.router.models.routes import ModelRoutes

# The queue_with_deadline wait is held by an open HTTP request: past a few minutes clients
# and proxies have given up on it anyway.
MAX_QUEUE_DEADLINE_S = 300.0
DEFAULT_CHECK_INTERVAL_S = 1.0
DEFAULT_WINDOW_S = 30.0

# The field each step needs.
_STEP_FIELDS = {
    Step.CAP_MAX_TOKENS: "max_tokens_cap",
    Step.FALLBACK_MODEL: "fallback_model",
    Step.QUEUE_WITH_DEADLINE: "queue_deadline_s",
}
_LADDER_FIELDS = ("engage_burn", "release_burn", "engage_queue_s", "release_queue_s",
                  "engage_after_s", "release_after_s", "reengage_window_s",
                  "max_release_after_s", "release_offered_ratio")  # fmt: skip
_KEYS = {"steps", "ttft_slo_s", "tpot_slo_s", "slo_percentile", "window_s", "min_requests",
         "check_interval_s", *_LADDER_FIELDS, *_STEP_FIELDS.values()}  # fmt: skip


@dataclass(frozen=True)
class DegradationSpec:
    """One model's ladder, SLO and the settings of its steps."""

    model: str  # the public name it is configured under
    names: frozenset[str]  # every name a request may send for it (the name, its aliases)
    ladder: LadderConfig
    targets: SloTargets
    window_s: float = DEFAULT_WINDOW_S
    check_interval_s: float = DEFAULT_CHECK_INTERVAL_S
    max_tokens_cap: int | None = None
    fallback_model: str | None = None
    queue_deadline_s: float | None = None


def _seconds(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{where}.{key} must be a number, got {value!r}")
    return float(value)


def _positive(raw: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    value = _seconds(raw, key, where, default)
    if value <= 0:
        raise ConfigError(f"{where}.{key} must be > 0, got {value:g}")
    return value


def _steps(raw: object, where: str) -> tuple[Step, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(
            f"{where}.steps must be a non-empty list of steps, in the order to take them: "
            f"{', '.join(s.value for s in Step)}"
        )
    steps = []
    for i, word in enumerate(raw):
        try:
            step = Step(word)
        except ValueError:
            raise ConfigError(
                f"{where}.steps[{i}]: unknown step {word!r}; known: "
                f"{', '.join(s.value for s in Step)}"
            ) from None
        if step in steps:
            raise ConfigError(f"{where}.steps lists {step.value} twice; each step goes once")
        steps.append(step)
    return tuple(steps)


def _spec(
    model: str, raw: object, where: str, routes: ModelRoutes, public: Collection[str] | None
) -> DegradationSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping with steps, ttft_slo_s and tpot_slo_s")
    check_keys(raw, _KEYS, where)
    steps = _steps(raw.get("steps"), where)
    for step, key in _STEP_FIELDS.items():
        if step in steps and raw.get(key) is None:
            raise ConfigError(f"{where}: step {step.value} needs {where}.{key}")
    for key in ("ttft_slo_s", "tpot_slo_s"):
        if key not in raw:
            raise ConfigError(f"{where}.{key} is required: the SLO the ladder climbs on")
    percentile = _seconds(raw, "slo_percentile", where, 90.0)
    if not 0 < percentile < 100:
        raise ConfigError(f"{where}.slo_percentile must be in (0, 100), got {percentile:g}")
    min_requests = raw.get("min_requests", 5)
    if isinstance(min_requests, bool) or not isinstance(min_requests, int) or min_requests < 1:
        raise ConfigError(f"{where}.min_requests must be an integer >= 1, got {min_requests!r}")
    defaults = LadderConfig()
    ladder_values = {k: _seconds(raw, k, where, getattr(defaults, k)) for k in _LADDER_FIELDS}
    for key, value in ladder_values.items():
        if value < 0:
            raise ConfigError(f"{where}.{key} must be >= 0, got {value:g}")
    try:
        ladder = LadderConfig(steps=steps, min_requests=min_requests, **ladder_values)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    cap = raw.get("max_tokens_cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"{where}.max_tokens_cap must be an integer >= 1, got {cap!r}")
    deadline = None
    if raw.get("queue_deadline_s") is not None:
        deadline = _positive(raw, "queue_deadline_s", where)
        if deadline > MAX_QUEUE_DEADLINE_S:
            raise ConfigError(f"{where}.queue_deadline_s must be at most "
                              f"{MAX_QUEUE_DEADLINE_S:g}, got {deadline:g}")  # fmt: skip
    names = _names(model, routes)
    fallback = raw.get("fallback_model")
    if fallback is not None:
        _check_fallback(fallback, names, where, public)
    return DegradationSpec(
        model=model,
        names=names,
        ladder=ladder,
        targets=SloTargets(
            ttft_s=_positive(raw, "ttft_slo_s", where),
            tpot_s=_positive(raw, "tpot_slo_s", where),
            percentile=percentile,
        ),
        window_s=_positive(raw, "window_s", where, DEFAULT_WINDOW_S),
        check_interval_s=_positive(raw, "check_interval_s", where, DEFAULT_CHECK_INTERVAL_S),
        max_tokens_cap=cap,
        fallback_model=fallback,
        queue_deadline_s=deadline,
    )


def _names(model: str, routes: ModelRoutes) -> frozenset[str]:
    """The name and, for a `models:` entry named so, its aliases."""
    for entry in routes.entries:
        if model == entry.name or model in entry.aliases:
            return frozenset((entry.name, *entry.aliases))
    return frozenset((model,))


def _check_fallback(
    fallback: object, names: frozenset[str], where: str, public: Collection[str] | None
) -> None:
    if not isinstance(fallback, str) or not fallback:
        raise ConfigError(f"{where}.fallback_model must be a model name, got {fallback!r}")
    if public is None:
        raise ConfigError(
            f"{where}.fallback_model needs a pools section: a gateway with one pool serves "
            "one model, so there is no other model to fall back to"
        )
    if fallback in names:
        raise ConfigError(f"{where}.fallback_model {fallback!r} is the model itself; name "
                          "another model this gateway serves")  # fmt: skip
    if fallback not in public:
        raise ConfigError(
            f"{where}.fallback_model {fallback!r} is not a model this gateway serves; "
            f"known: {sorted(public)} (a `models:` entry's name or alias, or a pool's "
            "served_model_name)"
        )


def parse_degradation(
    raw: object, routes: ModelRoutes, pool_served_names: Collection[str] | None
) -> dict[str, DegradationSpec]:
    """The section, by configured model name. ``pool_served_names``: the pools' configured
    served names (None: one pool from the command line, whose name only its workers know).
    With pools, each name must be one this gateway serves; a misspelt name would otherwise
    leave that model without its ladder and nobody told."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("degradation must be a mapping of model name -> its ladder")
    public: set[str] | None = None
    if pool_served_names is not None:
        public = set(routes.public_names({})) | set(pool_served_names)
    specs: dict[str, DegradationSpec] = {}
    claimed: dict[str, str] = {}  # each name a request may send -> the key that has it
    for model, item in raw.items():
        where = f"degradation.{model}"
        if not isinstance(model, str) or not model:
            raise ConfigError(f"degradation keys must be model names, got {model!r}")
        if public is not None and model not in public:
            raise ConfigError(
                f"{where}: {model!r} is not a model this gateway serves; known: {sorted(public)}"
            )
        spec = _spec(model, item, where, routes, public)
        for name in spec.names:
            if name in claimed:
                raise ConfigError(f"{where}: {name!r} already has a ladder under "
                                  f"degradation.{claimed[name]}; give a model one")  # fmt: skip
            claimed[name] = model
        specs[model] = spec
    return specs


def check_response_cache(specs: Mapping[str, DegradationSpec], is_cache_on: bool) -> None:
    """The response_cache step answers from the response cache: with it off, refused."""
    if is_cache_on:
        return
    for model, spec in specs.items():
        if Step.RESPONSE_CACHE in spec.ladder.steps:
            raise ConfigError(
                f"degradation.{model}.steps lists response_cache, but the response cache is "
                "off: turn it on with --response-cache on, or leave the step out"
            )


def by_request_name(specs: Mapping[str, DegradationSpec]) -> dict[str, DegradationSpec]:
    """Every name a request may send -> its model's spec."""
    return {name: spec for spec in specs.values() for name in spec.names}
