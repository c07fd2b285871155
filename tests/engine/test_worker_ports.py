"""A worker whose port is taken says which of its three ports and which flag moves it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from testkit.ports import free_port
from testkit.worker_process import running_worker

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("flag", ["--kv-port", "--port", "--metrics-port"])
def test_a_taken_port_is_named_with_its_flag(flag: str) -> None:
    port = free_port()
    with running_worker(["--simulate", flag, str(port)]):
        args = {"--port": "0", "--metrics-port": "0", "--kv-port": "0", flag: str(port)}
        done = subprocess.run(
            [sys.executable, "-m", "kvflow.cli.main", "worker", "--simulate",
             *(x for kv in args.items() for x in kv)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    assert f"port {port} ({flag})" in message, message
    assert f"Pick a free one with {flag}" in message
