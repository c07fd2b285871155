"""How long stored Responses live and how much memory holds them without Redis: the
settings and the flags (docs/router.md, "The Responses API")."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvflow.proto.cli_args import positive_int, seconds

DEFAULT_TTL_S = 30 * 24 * 3600.0  # OpenAI's 30 days
# A stored response holds its whole conversation: a 100-turn agent session of 8K-token
# prompts is a few MB of JSON, so memory keeps a few hundred such, or many thousand chats.
DEFAULT_MAX_MEMORY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ResponseStoreConfig:
    ttl_s: float = DEFAULT_TTL_S  # in Redis and in memory alike
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES  # without Redis: this replica's bound


def add_response_store_flags(p: argparse.ArgumentParser) -> None:
    d = ResponseStoreConfig()
    g = p.add_argument_group('stored Responses (docs/router.md, "The Responses API")')
    g.add_argument("--responses-ttl-s", type=seconds(allow_zero=False), default=d.ttl_s,
                   metavar="S", help="how long a stored Response (store: true) is kept "
                   "(default: %(default)s, 30 days)")  # fmt: skip
    g.add_argument("--responses-max-memory-bytes", type=positive_int,
                   default=d.max_memory_bytes, metavar="BYTES",
                   help="without --redis-url, the memory this replica keeps stored Responses "
                   "in, least recently used first out (default: %(default)s)")  # fmt: skip


def response_store_config(args: argparse.Namespace) -> ResponseStoreConfig:
    return ResponseStoreConfig(args.responses_ttl_s, args.responses_max_memory_bytes)
