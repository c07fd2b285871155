"""The pieces of an in-place KV transfer, each on its own: the run stream of a paged cache
(read, write, messages, iovecs), its revocable access, vectored socket I/O, and the
staging pool's reuse and bounds."""

from __future__ import annotations

import ctypes
import socket
import threading
import time

import numpy as np
import pytest
import torch

from kvflow.engine_worker.kv_transfer.base import TransferCancelledError
from kvflow.engine_worker.kv_transfer.blocks import MAX_MESSAGES, TransferBlocks
from kvflow.engine_worker.kv_transfer.staging import StagingPool
from kvflow.engine_worker.kv_transfer.vectored import IoVecCursor
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.engine_worker.runner import TorchModelRunner

LAYERS, HEADS, POOL, BS, DIM = 3, 2, 24, 4, 8  # a run (one block): 4 x 2 x 2 x 8 bf16 = 256 B
SHAPE = kv_cache_shape(num_blocks=POOL, block_size=BS, num_kv_heads=HEADS, head_dim=DIM)


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def stacked(kv_caches: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    """The reference layout: [layers, blocks, block_size, 2, heads, dim]."""
    return torch.stack([kv.index_select(0, torch.tensor(ids)) for kv in kv_caches])


SRC_IDS = [7, 3, 4, 5, 19, 0]
DST_IDS = [11, 12, 2, 23, 8, 9]


def test_the_stream_is_the_stacked_layout_and_lands_where_it_left() -> None:
    src, dst = caches(1), caches(2)
    before = [kv.clone() for kv in dst]
    blocks = TransferBlocks.in_cache(src, SRC_IDS)
    assert blocks.run_bytes == BS * 2 * HEADS * DIM * 2  # one block of one layer: K and V
    assert blocks.num_runs == LAYERS * len(SRC_IDS)
    out = torch.empty(blocks.num_bytes, dtype=torch.uint8)
    blocks.read(0, blocks.num_runs, out)
    want = stacked(src, SRC_IDS)
    assert torch.equal(out.view(torch.bfloat16).view(want.shape), want)
    TransferBlocks.in_cache(dst, DST_IDS).write(0, blocks.num_runs, out)
    assert torch.equal(stacked(dst, DST_IDS), want)
    others = [b for b in range(POOL) if b not in DST_IDS]
    assert torch.equal(stacked(dst, others), stacked(before, others))  # nothing else moved


def test_every_bit_pattern_survives_a_round_trip() -> None:
    """Runs move as 16-byte (complex128) elements; NaN payloads and signalling NaNs must
    come out bit for bit."""
    gen = torch.Generator().manual_seed(8)
    src = [torch.randint(0, 2**16, SHAPE, generator=gen, dtype=torch.int32).to(torch.int16)
           .view(torch.bfloat16) for _ in range(LAYERS)]  # fmt: skip
    src[0].view(torch.int16)[SRC_IDS[0], 0, 0, 0, :2] = torch.tensor([0x7F81, -0x7F])  # NaNs
    dst = caches(9)
    blocks = TransferBlocks.in_cache(src, SRC_IDS)
    buffer = torch.empty(blocks.num_bytes, dtype=torch.uint8)
    blocks.read(0, blocks.num_runs, buffer)
    TransferBlocks.in_cache(dst, DST_IDS).write(0, blocks.num_runs, buffer)
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[SRC_IDS].view(torch.int16), b[DST_IDS].view(torch.int16))


def test_pieces_straddle_layers_and_add_up_to_the_whole() -> None:
    src, dst = caches(3), caches(4)
    blocks = TransferBlocks.in_cache(src, SRC_IDS)
    whole = torch.empty(blocks.num_bytes, dtype=torch.uint8)
    blocks.read(0, blocks.num_runs, whole)
    sink = TransferBlocks.in_cache(dst, DST_IDS)
    messages = blocks.messages(max_bytes=4 * blocks.run_bytes)  # 6 runs a layer: straddles
    assert [n for _, n in messages] == [4] * 4 + [2]
    assert [f for f, _ in messages] == list(range(0, blocks.num_runs, 4))
    piece = torch.empty(4 * blocks.run_bytes, dtype=torch.uint8)
    for first, num_runs in messages:
        blocks.read(first, num_runs, piece)
        span = slice(first * blocks.run_bytes, (first + num_runs) * blocks.run_bytes)
        assert torch.equal(piece[: num_runs * blocks.run_bytes], whole[span])
        sink.write(first, num_runs, piece)
    assert torch.equal(stacked(dst, DST_IDS), stacked(src, SRC_IDS))


def test_a_huge_transfer_is_cut_into_at_most_max_messages() -> None:
    blocks = TransferBlocks.of_buffer(torch.zeros(MAX_MESSAGES * 3 + 1, 8, dtype=torch.uint8))
    messages = blocks.messages(max_bytes=8)
    assert len(messages) <= MAX_MESSAGES and sum(n for _, n in messages) == blocks.num_runs


def test_runner_block_io_round_trips_through_the_stream() -> None:
    def runner() -> TorchModelRunner:
        return TorchModelRunner(
            None,  # type: ignore[arg-type]
            num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, num_blocks=POOL,
            block_size=BS, dtype=torch.bfloat16,
        )  # fmt: skip

    a, b = runner(), runner()
    a.kv_caches[:] = caches(5)
    data = a.read_blocks(SRC_IDS)
    assert torch.equal(data, stacked(a.kv_caches, SRC_IDS))
    b.write_blocks(DST_IDS, data)
    assert torch.equal(stacked(b.kv_caches, DST_IDS), data)


def test_iovecs_address_every_run_and_merge_neighbours() -> None:
    src = caches(6)
    blocks = TransferBlocks.in_cache(src, SRC_IDS)  # 3, 4, 5 are neighbours in the pool
    iov = blocks.iovecs()
    # Per layer: 7 | 3 4 5 | 19 | 0 -> 4 entries instead of 6, each a whole block or more.
    assert len(iov) == LAYERS * 4
    assert sorted({int(n) for n in iov[:, 1]}) == [blocks.run_bytes, 3 * blocks.run_bytes]
    assert int(iov[:, 1].sum()) == blocks.num_bytes
    streamed = b"".join(ctypes.string_at(int(a), int(n)) for a, n in iov)
    want = torch.empty(blocks.num_bytes, dtype=torch.uint8)
    blocks.read(0, blocks.num_runs, want)
    assert streamed == want.numpy().tobytes()


def test_revoke_waits_for_an_access_in_progress_and_fails_later_ones() -> None:
    blocks = TransferBlocks.in_cache(caches(7), SRC_IDS)
    entered = threading.Event()

    def hold() -> None:
        with blocks.access():
            entered.set()
            time.sleep(0.3)

    thread = threading.Thread(target=hold)
    thread.start()
    entered.wait()
    started = time.monotonic()
    blocks.revoke()
    assert time.monotonic() - started >= 0.2  # waited for the piece in progress
    assert blocks.is_revoked
    with pytest.raises(TransferCancelledError), blocks.access():
        pass
    thread.join()


def test_iovec_cursor_moves_partial_steps_through_a_non_blocking_socket() -> None:
    payload = torch.arange(3 << 20, dtype=torch.int32).view(torch.uint8)  # 12 MiB
    runs = payload.view(-1, 4096)[torch.randperm(3 << 10)]  # scattered 4 KiB runs
    iov = np.stack(
        [
            np.array([r.data_ptr() for r in runs], dtype=np.uint64),
            np.full(len(runs), 4096, np.uint64),
        ],
        axis=1,
    )
    want = runs.reshape(-1).numpy().tobytes()
    a, b = socket.socketpair()
    a.setblocking(False)
    got = bytearray()
    cursor = IoVecCursor(iov)
    assert cursor.step(a.fileno(), write=True, max_bytes=10_000) == 10_000  # cut mid-run
    steps = 1
    while not cursor.is_done:
        moved = cursor.step(a.fileno(), write=True)
        steps += 1
        if moved == 0:  # the socket is full: drain it as a peer would
            got += b.recv(1 << 20)
    a.close()
    while chunk := b.recv(1 << 20):
        got += chunk
    assert bytes(got) == want and cursor.num_done == len(want)
    assert steps > 3  # it really moved in pieces


def test_staging_pool_reuses_touched_buffers_and_keeps_its_bounds() -> None:
    now = [0.0]
    pool = StagingPool(max_idle_bytes=3000, max_idle_s=10.0, clock=lambda: now[0])
    cpu = torch.device("cpu")
    a = pool.take(1000, cpu)
    pool.give(a)
    assert pool.take(1000, cpu) is a  # the same, touched memory
    assert pool.take(1000, cpu) is not a  # in use: a new one
    buffers = [pool.take(1000, cpu) for _ in range(4)]
    for buffer in buffers:
        pool.give(buffer)
    assert pool.num_idle_bytes == 3000  # the oldest went past the bound
    assert pool.take(1000, cpu) is buffers[1]
    assert pool.take(999, cpu).numel() == 999  # another size: a new buffer
    now[0] = 11.0
    pool.give(torch.empty(1000, dtype=torch.uint8))
    assert pool.num_idle_bytes == 1000  # the stale ones were dropped
