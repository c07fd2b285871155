"""The response cache's settings and flags (docs/router.md, "Response cache"). Kept apart
from the stores so that parsing the command line imports no Redis client."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvflow.proto.cli_args import number_of, seconds

KIB = 1024
MIB = 1024 * 1024


@dataclass(frozen=True)
class ResponseCacheConfig:
    # Off by default: a cached answer is not the model's answer of now (a model changed in
    # place under the same name and identity goes unseen), and callers of an OpenAI-
    # compatible server (vLLM, llm-d) expect every request to reach the model unless the
    # operator says otherwise.
    is_enabled: bool = False
    ttl_s: float = 300.0
    max_mib: float = 64.0  # the in-process store, without Redis
    max_entry_kib: float = 256.0  # a larger answer is not stored

    @property
    def max_bytes(self) -> int:
        return int(self.max_mib * MIB)

    @property
    def max_entry_bytes(self) -> int:
        return int(self.max_entry_kib * KIB)


def response_cache_flags(p: argparse.ArgumentParser, d: ResponseCacheConfig) -> None:
    g = p.add_argument_group(
        "response cache",
        "answer a repeated deterministic request (temperature 0 or a seed) from the stored "
        'answer (docs/router.md, "Response cache")',
    )
    g.add_argument(
        "--response-cache",
        choices=["on", "off"],
        default="on" if d.is_enabled else "off",
        help="(default: %(default)s)",
    )
    g.add_argument(
        "--response-cache-ttl-s",
        type=seconds(allow_zero=False),
        default=d.ttl_s,
        metavar="S",
        help="how long an answer is kept (default: %(default)s)",
    )
    g.add_argument(
        "--response-cache-max-mib",
        type=number_of("MiB", allow_zero=False),
        default=d.max_mib,
        metavar="MIB",
        help="the in-process store's size, used without "
        "--redis-url; least recently used answers go first (default: %(default)s)",
    )
    g.add_argument(
        "--response-cache-max-entry-kib",
        type=number_of("KiB", allow_zero=False),
        default=d.max_entry_kib,
        metavar="KIB",
        help="a larger answer is not stored (default: %(default)s)",
    )


def parse_response_cache(args: argparse.Namespace) -> ResponseCacheConfig:
    return ResponseCacheConfig(
        is_enabled=args.response_cache == "on",
        ttl_s=args.response_cache_ttl_s,
        max_mib=args.response_cache_max_mib,
        max_entry_kib=args.response_cache_max_entry_kib,
    )
