"""The router's flags for limits at the client-IP and global levels, and for the proxies
whose X-Forwarded-For is believed (docs/router.md, "Limits at four levels"). Per-model
limits are in the config file only (`rate_limits.models`, by served model name). A flag
given replaces the config file's value."""

from __future__ import annotations

import argparse
from dataclasses import replace

from kvflow.proto.cli_args import positive_int, seconds
from kvflow.router.config_fields import ConfigError
from kvflow.router.limits.levels import KINDS, LevelLimits, LimitsConfig, parse_cidrs

_LEVEL_FLAGS = {"global": "global_limits", "client-ip": "client_ip"}
_KIND_HELP = {
    "requests_per_minute": "requests per minute (a one-minute burst)",
    "tokens_per_minute": "prompt + completion tokens per minute (reserved at admission: "
    "prompts plus every choice's max_tokens; what is not generated is given back)",
    "max_in_flight": "requests running at once",
}


def _dest(level: str, kind: str) -> str:
    return f"{level.replace('-', '_')}_{kind}"


def rate_limit_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "limits per client IP and for the whole gateway",
        "shared by the router replicas through --redis-url; past one a request gets 429 with "
        'Retry-After and x-kvflow-limit naming it (docs/router.md, "Limits at four levels"); '
        "default: the config's rate_limits section, else unlimited",
    )
    for level in _LEVEL_FLAGS:
        who = "one client address" if level == "client-ip" else "the gateway, all replicas"
        for kind in KINDS:
            g.add_argument(f"--{level}-{kind.replace('_', '-')}", dest=_dest(level, kind),
                           type=positive_int, metavar="N",
                           help=f"most {_KIND_HELP[kind]} for {who}")  # fmt: skip
    g.add_argument(
        "--trusted-proxy-cidrs",
        metavar="CIDR,...",
        help="peers in these networks are proxies whose X-Forwarded-For is believed: the "
        "client is its right-most address outside them (default: none, the peer is the "
        "client)",
    )
    g.add_argument(
        "--limit-lease-ttl-s",
        type=seconds(allow_zero=False),
        metavar="S",
        help="an in-flight slot held in Redis by a replica that died is freed after this; "
        "live replicas renew theirs every third of it (default: the config's, else 60)",
    )


def apply_rate_limit_flags(args: argparse.Namespace, config: LimitsConfig) -> LimitsConfig:
    """``config`` (the file's) with the flags given laid over it."""
    for level, field_name in _LEVEL_FLAGS.items():
        limits: LevelLimits = getattr(config, field_name)
        given = {k: getattr(args, _dest(level, k)) for k in KINDS}
        given = {k: v for k, v in given.items() if v is not None}
        if given:
            merged = replace(limits, **given)
            if field_name == "global_limits":
                config = replace(config, global_limits=merged)
            else:
                config = replace(config, client_ip=merged)
    if args.trusted_proxy_cidrs is not None:
        cidrs = [c for c in args.trusted_proxy_cidrs.split(",") if c.strip()]
        config = replace(config, trusted_proxies=parse_cidrs(cidrs, "--trusted-proxy-cidrs"))
    if args.limit_lease_ttl_s is not None:
        if args.limit_lease_ttl_s < 1:
            raise ConfigError(f"--limit-lease-ttl-s must be >= 1, got {args.limit_lease_ttl_s}")
        config = replace(config, lease_ttl_s=args.limit_lease_ttl_s)
    return config
