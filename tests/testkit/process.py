"""Start a real `kvflow <command>` process and wait for its machine-readable ready line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class KvflowProcess:
    proc: subprocess.Popen[str]
    ready_line: str
    output: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        return "".join(self.output)

    def ready_fields(self) -> dict[str, str]:
        """``KEY=VALUE`` pairs of the ready line, e.g. ``{"grpc_port": "4321"}``."""
        return dict(part.split("=", 1) for part in self.ready_line.split()[1:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Signal, wait, and kill if it does not exit in time; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _pump(
    proc: subprocess.Popen[str], prefix: str, lines: list[str], ready: threading.Event
) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            ready.set()
    ready.set()  # exited: wake the waiter, who will find no ready line


def launch_kvflow(
    args: Sequence[str],
    *,
    ready_prefix: str,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> KvflowProcess:
    """Run `kvflow ARGS` and return once it prints a line starting with ``ready_prefix``;
    ``env`` adds to this process's environment."""
    cmd = [sys.executable, "-m", "kvflow.cli.main", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=Path.cwd()
    )
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, ready_prefix, lines, ready), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(timeout=0.5):
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"kvflow {args[0]} not ready after {timeout_s} s:\n{''.join(lines)}")
    ready_line = next((x for x in lines if x.startswith(ready_prefix)), None)
    if ready_line is None:
        proc.wait(timeout=10)
        raise RuntimeError(
            f"kvflow {args[0]} exited ({proc.returncode}) before ready:\n{''.join(lines)}"
        )
    return KvflowProcess(proc, ready_line.strip(), lines)
