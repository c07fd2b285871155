"""Fault injection for tests only: the gRPC service's hooks, read from the environment once.

Each makes a real worker misbehave the way a broken or stalled one would, for the router's
tests to watch it cope: a stale KV index, a stream that stalls, a call that fails or hangs.
None is ever set in production. Kept apart so that the service reads without them.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc

from kvflow.engine_worker.error_status import Context

# Publish evictions with no block hashes, so that subscribers (the router's index) go on
# believing this worker holds blocks it evicted, as they would while events are lost or late.
HIDE_KV_REMOVALS = os.environ.get("KVFLOW_FAULT_HIDE_KV_REMOVALS") == "1"
# After this many token messages of a Generate stream, stop sending for
# KVFLOW_FAULT_STREAM_PAUSE_S while the engine runs on: a worker that stalls mid-stream, as
# the router sees it (its token-stall deadline).
STREAM_PAUSE_AFTER = int(os.environ.get("KVFLOW_FAULT_STREAM_PAUSE_AFTER", "0"))
STREAM_PAUSE_S = float(os.environ.get("KVFLOW_FAULT_STREAM_PAUSE_S", "0"))
# While the file this names exists, each Generate call reads it first: a gRPC status name
# (INTERNAL, ABORTED, ...) fails the call with that status before any token; "stall" holds
# the call, sending nothing, until the file is gone. Health and Load answer as usual, so a
# test removes the file to make the worker recover, without a restart.
GENERATE_FILE = os.environ.get("KVFLOW_FAULT_GENERATE_FILE", "")


async def generate_fault(context: Context) -> None:
    """Apply GENERATE_FILE's fault to one Generate call, if the file is there."""
    try:
        fault = Path(GENERATE_FILE).read_text().strip()
    except FileNotFoundError:
        return
    if fault == "stall":
        while Path(GENERATE_FILE).exists():
            await asyncio.sleep(0.05)
        return
    await context.abort(grpc.StatusCode[fault], "fault injected (KVFLOW_FAULT_GENERATE_FILE)")
