"""The zero-copy what-if of the KV transfer benchmark: blocks go from the sender's paged
cache to the socket and from the socket into the receiver's paged cache with no gather and
no scatter, by vectored I/O (sendmsg / recvmsg_into over lists of the blocks' memory).

In the head-major cache ([2, kv_heads, blocks, block_size, head_dim] per layer) one block
of one head's keys or values is a contiguous run of block_size x head_dim elements (4 KiB
in bf16), so a transfer is layers x 2 x kv_heads x blocks runs: 262,144 for 8k tokens of
Llama-3-8B, moved in calls of at most IOV_MAX (1024) runs each.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import torch

from kvflow.engine_worker.kv_transfer.tcp import byte_view

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg/recvmsg call


def block_runs(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[memoryview]:
    """Writable views of every (layer, K/V, head, block) run, in transfer order."""
    runs = []
    for kv in kv_caches:
        two, heads, num_blocks, size, dim = kv.shape
        run_bytes = size * dim * kv.element_size()
        mem = byte_view(kv)
        for row in range(two * heads):
            base = row * num_blocks
            runs += [mem[(base + b) * run_bytes : (base + b + 1) * run_bytes] for b in block_ids]
    return runs


def send_runs(sock: socket.socket, runs: list[memoryview]) -> None:
    i, offset = 0, 0  # the first run not fully sent, and how much of it was
    while i < len(runs):
        batch = [runs[i][offset:], *runs[i + 1 : i + IOV_MAX]]
        sent = sock.sendmsg(batch)
        i, offset = _advance(runs, i, offset, sent)


def recv_runs(sock: socket.socket, runs: list[memoryview]) -> None:
    i, offset = 0, 0
    while i < len(runs):
        got = sock.recvmsg_into([runs[i][offset:], *runs[i + 1 : i + IOV_MAX]])[0]
        if got == 0:
            raise ConnectionError("the sender closed the stream early")
        i, offset = _advance(runs, i, offset, got)


def _advance(runs: list[memoryview], i: int, offset: int, num_bytes: int) -> tuple[int, int]:
    while num_bytes > 0:
        left = len(runs[i]) - offset
        if num_bytes < left:
            return i, offset + num_bytes
        num_bytes -= left
        i, offset = i + 1, 0
    return i, offset
