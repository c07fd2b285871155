"""Start real `kvflow worker` processes for tests, on free ports, always cleaned up."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from testkit.process import KvflowProcess, launch_kvflow

READY_PREFIX = "KVFLOW_WORKER_READY"


class WorkerProcess(KvflowProcess):
    @property
    def grpc_port(self) -> int:
        return int(self.ready_fields()["grpc_port"])

    @property
    def metrics_port(self) -> int:
        return int(self.ready_fields()["metrics_port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def launch_worker(
    args: Sequence[str], *, timeout_s: float = 180.0, env: Mapping[str, str] | None = None
) -> WorkerProcess:
    """Start `kvflow worker ARGS --port 0 --metrics-port 0 --kv-port 0` and wait for its
    ready line."""
    started = launch_kvflow(
        ["worker", "--port", "0", "--metrics-port", "0", "--kv-port", "0", *args],
        ready_prefix=READY_PREFIX,
        timeout_s=timeout_s,
        env=env,
    )
    return WorkerProcess(started.proc, started.ready_line, started.output)


@contextmanager
def running_worker(args: Sequence[str], *, timeout_s: float = 180.0) -> Iterator[WorkerProcess]:
    worker = launch_worker(args, timeout_s=timeout_s)
    try:
        yield worker
    finally:
        worker.stop(timeout_s=10.0)
