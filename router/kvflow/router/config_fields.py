"""Reading the router's YAML config: the one error type, and the checks every section
shares (settings.py and models/ both parse parts of one file)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.router.routing.placement import DisaggregationConfig


class ConfigError(ValueError):
    """The configuration file is invalid; the message names the field."""


def section(raw: Mapping[str, Any], key: str, where: str = "") -> Mapping[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}{key} must be a mapping")
    return value


def check_keys(raw: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")


def parse_disaggregation(
    raw: Mapping[str, Any], where: str = "disaggregation", base: DisaggregationConfig | None = None
) -> DisaggregationConfig:
    """``base``: what a field left out takes (a pool's section falls back on the top-level
    one); None: the built-in defaults."""
    d = base if base is not None else DisaggregationConfig()
    check_keys(raw, {"enabled", "min_remote_prefill_tokens", "max_prefill_queue_depth",
                     "transfer_timeout_s"}, where)  # fmt: skip
    enabled = raw.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}.enabled must be true or false, got {enabled!r}")
    counts = {}
    for name in ("min_remote_prefill_tokens", "max_prefill_queue_depth"):
        value = raw.get(name, getattr(d, name))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{where}.{name} must be an integer >= 0, got {value!r}")
        counts[name] = value
    timeout_s = raw.get("transfer_timeout_s", d.transfer_timeout_s)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
        raise ConfigError(
            f"{where}.transfer_timeout_s must be a number of seconds > 0, got {timeout_s!r}"
        )
    return DisaggregationConfig(
        enabled=enabled,
        min_remote_prefill_tokens=counts["min_remote_prefill_tokens"],
        max_prefill_queue_depth=counts["max_prefill_queue_depth"],
        transfer_timeout_s=float(timeout_s),
    )
