"""One Load poll per worker: the gateway's worker pool asks each worker for its load once
per interval, and routing and admission control both read that answer (workers/book.py).
Counted on fake workers over real gRPC, under a real gateway process with admission on."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import pytest
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import running_gateway

from kvflow.proto import worker_pb2 as pb

pytestmark = pytest.mark.integration

LOAD_INTERVAL_S = 0.25  # workers/book.py; admission's default 0.5 s is no oftener
WINDOW_S = 4.0


@dataclass
class CountingWorker(FakeWorker):
    load_times_s: list[float] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:  # noqa: N802
        with self._lock:
            self.load_times_s.append(time.monotonic())
        return await super().Load(request, context)

    def num_loads_between(self, start_s: float, end_s: float) -> int:
        with self._lock:
            return sum(start_s <= t < end_s for t in self.load_times_s)


def test_each_worker_is_asked_for_its_load_once_per_interval() -> None:
    workers = [CountingWorker(), CountingWorker()]
    with ExitStack() as stack:
        addresses = [stack.enter_context(running_fake_worker(w)) for w in workers]
        gateway = stack.enter_context(running_gateway(["--workers", ",".join(addresses)]))
        gateway.wait_ready(num_workers=len(addresses))
        time.sleep(1.0)  # past start-up: both workers healthy and polled
        start_s = time.monotonic()
        time.sleep(WINDOW_S)
        end_s = time.monotonic()
    most = WINDOW_S / LOAD_INTERVAL_S  # 16: a second poller at 0.5 s would add 8
    for worker in workers:
        num = worker.num_loads_between(start_s, end_s)
        # At most one interval's slack; at least half the rate (a loaded machine is slow).
        assert most / 2 <= num <= most + 1, (num, most)
