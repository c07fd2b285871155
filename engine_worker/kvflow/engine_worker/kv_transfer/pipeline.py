"""A transfer as a pipeline of messages over torch.distributed point-to-point (gloo, NCCL).

gloo and NCCL move one contiguous tensor per message, so the run stream (blocks.py) is cut
into messages of up to 16 MiB that pass through PIPELINE_DEPTH pooled staging buffers:
the sender gathers message i + 1 while message i is on the wire, the receiver scatters
message i while i + 1 arrives. Message ``i`` goes under tag ``transfer tag | i << 20``, so
messages never depend on gloo matching same-tag messages in order. One contiguous message
per transfer, gathered and scattered whole by the engine thread, ran at 10-19 % of the
loopback ceiling (docs/benchmarks.md).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from kvflow.engine_worker.kv_transfer.base import KvTransferError, TransferTimeoutError
from kvflow.engine_worker.kv_transfer.blocks import MAX_MESSAGES, TransferBlocks
from kvflow.engine_worker.kv_transfer.staging import PIPELINE_DEPTH, StagingPool

# Transfer tags (the agent's) stay below 2**20; the message index takes the 11 bits above.
TAG_BITS = 20
assert MAX_MESSAGES <= 2 ** (31 - TAG_BITS)


def message_tag(tag: int, index: int) -> int:
    assert 0 <= tag < 2**TAG_BITS and 0 <= index < MAX_MESSAGES
    return tag | index << TAG_BITS


@dataclass(frozen=True, slots=True)
class Staging:
    """Where a transfer's staging buffers come from and how large its messages are."""

    pool: StagingPool
    device: torch.device
    message_bytes: int

    def take(self, blocks: TransferBlocks, messages: list[tuple[int, int]]) -> list[torch.Tensor]:
        capacity = messages[0][1] * blocks.run_bytes
        count = min(PIPELINE_DEPTH, len(messages))
        return [self.pool.take(capacity, self.device) for _ in range(count)]

    def give(self, buffers: list[torch.Tensor]) -> None:
        """Only once nothing may still move them (never after a failure)."""
        for buffer in buffers:
            self.pool.give(buffer)


# How often a CUDA transfer's completion is polled: well under one 16 MiB message on NVLink.
_CUDA_POLL_S = 100e-6


# gloo takes a wait's timeout in whole milliseconds, cut down: a wait of 2.9957 s returned
# after 2,995 ms, before the deadline, and its timeout was taken for a failed transfer. So a
# wait asks for whole milliseconds rounded up, and a failure within this much of the
# deadline is its timeout (a peer that breaks the connection fails the wait at once).
_DEADLINE_SLACK_S = 0.005


def wait_timeout(deadline_s: float) -> timedelta:
    """What is left until ``deadline_s``, in whole milliseconds rounded up (at least 1)."""
    return timedelta(milliseconds=max(math.ceil((deadline_s - time.monotonic()) * 1e3), 1))


def wait_work(work: Any, deadline_s: float, what: str, device: torch.device) -> None:
    """Wait for a send or receive until the deadline. Gloo's point-to-point work reports
    completion only through wait(), and a wait cannot be interrupted: cancellation is the
    agent's (it stops listening and lets this thread run out its deadline).

    NCCL's wait() returns at once: it only orders the current CUDA stream after the
    operation, which keeps the data correct but would let a peer that never posts its half
    hang the stream with no deadline tripped. So on CUDA the host polls completion first."""
    try:
        if device.type == "cuda":
            while not work.is_completed():
                if time.monotonic() >= deadline_s:
                    raise TransferTimeoutError(f"{what} timed out")
                time.sleep(_CUDA_POLL_S)
        work.wait(wait_timeout(deadline_s))
    except RuntimeError as exc:
        if time.monotonic() >= deadline_s - _DEADLINE_SLACK_S:
            raise TransferTimeoutError(f"{what} timed out") from exc
        raise KvTransferError(f"{what} failed: {exc}") from exc


def send_messages(
    group: Any, blocks: TransferBlocks, tag: int, deadline_s: float, staging: Staging, *, what: str
) -> None:
    """Gather and send every message to rank 1 of ``group``."""
    messages = blocks.messages(staging.message_bytes)
    buffers = staging.take(blocks, messages)
    in_flight: deque[Any] = deque()
    for i, (first, num_runs) in enumerate(messages):
        if len(in_flight) == len(buffers):
            wait_work(in_flight.popleft(), deadline_s, what, staging.device)
        buffer = buffers[i % len(buffers)]
        with blocks.access():
            blocks.read(first, num_runs, buffer)
        payload = buffer[: num_runs * blocks.run_bytes]
        in_flight.append(group.send([payload], 1, message_tag(tag, i)))
    while in_flight:
        wait_work(in_flight.popleft(), deadline_s, what, staging.device)
    staging.give(buffers)


def receive_messages(
    group: Any, blocks: TransferBlocks, tag: int, deadline_s: float, staging: Staging, *, what: str
) -> None:
    """Receive every message from rank 0 of ``group`` and scatter it into ``blocks``."""
    messages = blocks.messages(staging.message_bytes)
    buffers = staging.take(blocks, messages)

    def post(i: int) -> Any:
        payload = buffers[i % len(buffers)][: messages[i][1] * blocks.run_bytes]
        return group.recv([payload], 0, message_tag(tag, i))

    in_flight = deque(post(i) for i in range(len(buffers)))
    for i, (first, num_runs) in enumerate(messages):
        wait_work(in_flight.popleft(), deadline_s, what, staging.device)
        with blocks.access():
            blocks.write(first, num_runs, buffers[i % len(buffers)])
        if i + len(buffers) < len(messages):
            in_flight.append(post(i + len(buffers)))
    staging.give(buffers)
