"""`kvflow worker`'s scheduler flags: step budgets, the waiting queue's bounds, and the
simulator that runs the real scheduler with a timing model instead of a model."""

from __future__ import annotations

import argparse

from kvflow.engine_worker.settings.record import WorkerSettings
from kvflow.proto.cli_args import number_of, positive_int, seconds

# `kvflow worker`'s queue bound: a full default batch four deep (256 behind 64 running),
# minutes of queue on a CPU, tens of seconds on a GPU. Past it a request is refused at once
# (RESOURCE_EXHAUSTED, with a retry-after) and the router tries another worker or answers 503.
DEFAULT_MAX_WAITING_REQUESTS = 256

# A simulated step's times (--sim-*-ms): any finite amount, none negative.
_ms = number_of("ms", allow_zero=True)


def add_scheduler_flags(p: argparse.ArgumentParser, d: WorkerSettings) -> None:
    p.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=d.max_num_batched_tokens,
        help="token budget of one step (bounds prefill chunks)",
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="requests running at once"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests that may wait for a slot; past it a new one is refused at once with "
        "RESOURCE_EXHAUSTED and a retry-after (the router tries another worker or answers 503)",
    )
    p.add_argument(
        "--max-queue-time-s",
        type=seconds(allow_zero=False),
        help="also refuse a request whose estimated wait (requests ahead / admissions per "
        "second) is longer than this (default: no bound on time)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="no model: the real scheduler and KV accounting with a timing model",
    )
    p.add_argument(
        "--sim-profile",
        help="with --simulate: step timing and KV geometry of a GPU and model, by name "
        "(h100-llama3-8b, h200-llama3-8b, h100x4-llama3-70b, h200x2-llama3-70b) or a "
        "file from `kvflow profile`; the KV block count is the profile's unless "
        "--num-kv-blocks is given (instead of the --sim-*-ms flags)",
    )
    p.add_argument("--sim-base-step-ms", type=_ms, default=d.sim_base_step_ms)
    p.add_argument("--sim-per-token-ms", type=_ms, default=d.sim_per_token_ms)
    p.add_argument("--sim-per-seq-ms", type=_ms, default=d.sim_per_seq_ms)
