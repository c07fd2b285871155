"""Start real `kvflow worker` processes for tests, on free ports, always cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

READY_PREFIX = "KVFLOW_WORKER_READY"


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    grpc_port: int
    metrics_port: int
    output: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def log(self) -> str:
        return "".join(self.output)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _pump(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(READY_PREFIX):
            ready.set()
    ready.set()  # exited: wake the waiter, who will find no ready line


def launch_worker(args: Sequence[str], *, timeout_s: float = 180.0) -> WorkerProcess:
    """Start `kvflow worker ARGS --port 0 --metrics-port 0` and wait for its ready line."""
    cmd = [
        sys.executable,
        "-m",
        "kvflow.cli.main",
        "worker",
        "--port",
        "0",
        "--metrics-port",
        "0",
        *args,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path.cwd()
    )
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, lines, ready), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(timeout=0.5):
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"worker not ready after {timeout_s} s:\n{''.join(lines)}")
    ready_line = next((x for x in lines if x.startswith(READY_PREFIX)), None)
    if ready_line is None:
        proc.wait(timeout=10)
        raise RuntimeError(f"worker exited ({proc.returncode}) before ready:\n{''.join(lines)}")
    fields = dict(part.split("=") for part in ready_line.split()[1:])
    return WorkerProcess(proc, int(fields["grpc_port"]), int(fields["metrics_port"]), lines)


@contextmanager
def running_worker(args: Sequence[str], *, timeout_s: float = 180.0) -> Iterator[WorkerProcess]:
    worker = launch_worker(args, timeout_s=timeout_s)
    try:
        yield worker
    finally:
        worker.stop(timeout_s=10.0)
