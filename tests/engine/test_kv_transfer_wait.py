"""wait_work's deadline on CUDA, where NCCL's wait() returns before the bytes have moved.

A unit test of one function with stand-ins for torch.distributed's Work: no machine here
has NCCL. The gloo path runs for real in test_kv_transfer_agent.py.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from kvflow.engine_worker.kv_transfer.base import KvTransferError, TransferTimeoutError
from kvflow.engine_worker.kv_transfer.pipeline import wait_work

CUDA = torch.device("cuda")


class NcclLikeWork:
    """Completes after ``done_after_s`` (never when None); wait() returns at once, as NCCL's."""

    def __init__(self, done_after_s: float | None, error: str | None = None) -> None:
        self._done_at = None if done_after_s is None else time.monotonic() + done_after_s
        self._error = error
        self.waited = False

    def is_completed(self) -> bool:
        return self._done_at is not None and time.monotonic() >= self._done_at

    def wait(self, timeout: timedelta) -> bool:
        self.waited = True
        if self._error:
            raise RuntimeError(self._error)
        return True


def test_a_cuda_operation_that_never_completes_trips_the_deadline() -> None:
    work = NcclLikeWork(done_after_s=None)
    started = time.monotonic()
    with pytest.raises(TransferTimeoutError, match="receiving transfer t1 timed out"):
        wait_work(work, started + 0.2, "receiving transfer t1", CUDA)
    assert 0.2 <= time.monotonic() - started < 1.0
    assert not work.waited


def test_a_cuda_operation_is_waited_for_until_it_completes() -> None:
    work = NcclLikeWork(done_after_s=0.05)
    started = time.monotonic()
    wait_work(work, started + 5, "sending transfer t2", CUDA)
    assert work.is_completed() and work.waited
    assert time.monotonic() - started < 1.0


def test_a_failed_cuda_operation_is_a_transfer_error() -> None:
    work = NcclLikeWork(done_after_s=0, error="NCCL error: remote process exited")
    with pytest.raises(KvTransferError, match="remote process exited") as caught:
        wait_work(work, time.monotonic() + 5, "sending transfer t3", CUDA)
    assert not isinstance(caught.value, TransferTimeoutError)


class GlooLikeWork:
    """Never completes; wait() blocks for its timeout cut down to whole milliseconds, as
    gloo's does, then raises gloo's timeout."""

    def __init__(self) -> None:
        self.timeouts_ms: list[int] = []

    def wait(self, timeout: timedelta) -> bool:
        ms = int(timeout.total_seconds() * 1e3)
        self.timeouts_ms.append(ms)
        time.sleep(ms / 1e3)
        raise RuntimeError(f"Timed out waiting {ms}ms for recv operation to complete")


def test_gloos_timeout_in_whole_milliseconds_is_the_transfers_timeout() -> None:
    """A wait asked for 2.9957 s returned after 2,995 ms, before the deadline, and was taken
    for a failed transfer (KvTransferError, not TransferTimeoutError): the wait asks for
    whole milliseconds rounded up."""
    work = GlooLikeWork()
    deadline_s = time.monotonic() + 0.2997
    with pytest.raises(TransferTimeoutError, match="receiving transfer t4 timed out"):
        wait_work(work, deadline_s, "receiving transfer t4", torch.device("cpu"))
    assert work.timeouts_ms[0] >= 300
    assert time.monotonic() >= deadline_s


def test_a_gloo_failure_well_before_the_deadline_is_a_transfer_error() -> None:
    work = NcclLikeWork(done_after_s=0, error="Connection closed by peer [127.0.0.1]:5000")
    with pytest.raises(KvTransferError, match="closed by peer") as caught:
        wait_work(work, time.monotonic() + 5, "receiving transfer t5", torch.device("cpu"))
    assert not isinstance(caught.value, TransferTimeoutError)
