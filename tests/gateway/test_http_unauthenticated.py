"""A router without tenants serves anonymous callers (as admins) only on loopback, as
`kvflow up` runs it, or when told to with --allow-unauthenticated; elsewhere it refuses to
start, naming the flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import launch_gateway

from kvflow.router.cli import parse_args
from kvflow.router.cli_security import is_loopback, unauthenticated_problem
from kvflow.router.tenants.config import hash_api_key


@pytest.mark.parametrize(
    ("host", "expected"),
    [("127.0.0.1", True), ("127.5.0.1", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("router.example", False)],
)  # fmt: skip
def test_loopback_hosts(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


def test_only_an_open_router_off_loopback_without_the_flag_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(f"tenants: [{{name: a, api_key_sha256: [{hash_api_key('sk-a')}]}}]\n")
    cases = {
        ("--host", "0.0.0.0"): True,
        ("--host", "0.0.0.0", "--allow-unauthenticated"): False,
        ("--host", "127.0.0.1"): False,
        ("--host", "0.0.0.0", "--config", str(config)): False,
        ("--host", "0.0.0.0", "--tenants-file", str(config)): False,
    }
    for args, is_refused in cases.items():
        settings = parse_args([*args, "--workers", "127.0.0.1:1"], env={})
        assert settings is not None
        problem = unauthenticated_problem(settings)
        assert (problem is not None) is is_refused, args
        if problem is not None:
            assert "--allow-unauthenticated" in problem and "0.0.0.0" in problem


@pytest.mark.integration
def test_the_router_refuses_to_start_open_on_every_address_unless_allowed() -> None:
    cmd = [sys.executable, "-m", "kvflow.cli.main", "router", "--host", "0.0.0.0", "--port",
           "0", "--workers", "127.0.0.1:1"]  # fmt: skip
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--allow-unauthenticated" in done.stderr and "tenants" in done.stderr
    # With the flag it serves, and the anonymous caller is the admin it was.
    with running_fake_worker(FakeWorker(tokens=(1, 2))) as address:
        g = launch_gateway(["--host", "0.0.0.0", "--allow-unauthenticated", "--workers", address])
        try:
            g.wait_ready(num_workers=1)
            r = httpx.post(f"{g.base_url}/completions", headers={"x-kvflow-route": "1"},
                           json={"model": "fake", "prompt": "hi", "max_tokens": 2})  # fmt: skip
            assert r.status_code == 200 and address in r.headers["x-kvflow-route"]
        finally:
            g.stop()
