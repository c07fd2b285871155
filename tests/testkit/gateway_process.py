"""Start real `kvflow router` processes for tests, on free ports, always cleaned up."""

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

import httpx

READY_PREFIX = "KVFLOW_ROUTER_READY"


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[str]
    port: int
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes."""
        return f"{self.url}/v1"

    @property
    def log(self) -> str:
        return "".join(self.output)

    def wait_ready(self, *, num_workers: int = 1, timeout_s: float = 60.0) -> None:
        """Until /ready reports at least ``num_workers`` healthy workers."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                body = httpx.get(f"{self.url}/ready", timeout=5).json()
                if body["workers_healthy"] >= num_workers:
                    return
                last = str(body)
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready with {num_workers} workers: {last}\n{self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
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
    ready.set()


def launch_gateway(args: Sequence[str], *, timeout_s: float = 90.0) -> GatewayProcess:
    """Start `kvflow router --host 127.0.0.1 --port 0 ARGS` and wait for its ready line."""
    cmd = [sys.executable, "-m", "kvflow.cli.main", "router", "--host", "127.0.0.1",
           "--port", "0", *args]  # fmt: skip
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
            raise TimeoutError(f"gateway not ready after {timeout_s} s:\n{''.join(lines)}")
    ready_line = next((x for x in lines if x.startswith(READY_PREFIX)), None)
    if ready_line is None:
        proc.wait(timeout=10)
        raise RuntimeError(f"gateway exited ({proc.returncode}) before ready:\n{''.join(lines)}")
    port = int(ready_line.split("port=")[1])
    return GatewayProcess(proc, port, lines)


@contextmanager
def running_gateway(args: Sequence[str], *, timeout_s: float = 90.0) -> Iterator[GatewayProcess]:
    gateway = launch_gateway(args, timeout_s=timeout_s)
    try:
        yield gateway
    finally:
        gateway.stop()
