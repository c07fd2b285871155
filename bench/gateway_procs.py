"""Processes of the gateway benchmark: stub workers, a gateway per arm, a real redis-server,
the tenant config that arm runs with, and the CPU each process spent.

A gateway arm is one configuration of the real gateway, started when its measurement
starts and stopped after it, so no arm (least of all the direct one) shares the machine
with a gateway it does not measure:

  open            no tenants: any key, in-process state (what `kvflow up` runs)
  tenants         one tenant with all four quotas, in-process quota store
  tenants-redis   the same tenant, quotas in a real redis-server (the multi-tenant path:
                  an admit script before routing, a finish script and a usage pipeline
                  after the last token)
  tenants-redis-deferred  tenants-redis with the settlement (finish + usage) run after the
                  response is sent: a what-if of a router change (bench/gateway_instrumented.py;
                  docs/benchmarks.md has what it measured)
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from testkit.ports import free_port

ROOT = Path(__file__).resolve().parent
MODEL = "stub"
API_KEY = "sk-bench-" + "0" * 40
TENANT = "bench"
# Generous enough never to refuse a request of this benchmark (300 req/s of ~60 tokens for
# a few minutes), tight enough that every quota is a real check in the admit script.
TENANT_QUOTAS = {
    "requests_per_minute": 1_000_000,
    "tokens_per_minute": 100_000_000,
    "max_concurrent_requests": 10_000,
    "daily_token_budget": 10_000_000_000,
}
GATEWAY_ARMS = ("open", "tenants", "tenants-redis", "tenants-redis-deferred")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def start(cmd: list[str], ready: str, timeout_s: float = 120) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stdout:
        if line.startswith(ready):
            return proc, line.strip()
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{cmd} did not start")


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def start_redis() -> tuple[subprocess.Popen[str], str]:
    """A fresh redis-server on a free loopback port, no persistence; (process, URL)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: apt-get install -y redis-server")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def write_tenant_config(path: Path) -> Path:
    import hashlib

    tenant = {"name": TENANT, "api_key_sha256": [hashlib.sha256(API_KEY.encode()).hexdigest()],
              "models": [MODEL], **TENANT_QUOTAS}  # fmt: skip
    path.write_text(yaml.safe_dump({"tenants": [tenant]}))
    return path


@dataclass
class GatewayArm:
    """A running gateway (and its redis-server) for one arm."""

    name: str
    url: str
    gateway: subprocess.Popen[str]
    redis: subprocess.Popen[str] | None
    is_instrumented: bool = False

    def measurement_starts(self) -> None:
        """An instrumented gateway forgets the stage times of the warm-up."""
        if self.is_instrumented:
            self.gateway.send_signal(signal.SIGUSR1)

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.name == "open" else {"Authorization": f"Bearer {API_KEY}"}

    def cpu_s(self) -> dict[str, float]:
        cpu = {"gateway": cpu_s(self.gateway.pid)}
        if self.redis is not None:
            cpu["redis"] = cpu_s(self.redis.pid)
        return cpu

    def stop(self) -> None:
        stop([self.gateway, *([self.redis] if self.redis is not None else [])])


def start_gateway_arm(
    name: str, addresses: list[str], workdir: Path, *, stage_times: Path | None = None
) -> GatewayArm:
    """Start the arm's gateway (and redis-server); ``stage_times``: run it instrumented
    (bench/gateway_instrumented.py) and have it write per-stage times there on exit."""
    assert name in GATEWAY_ARMS, name
    redis, extra = None, []
    if name != "open":
        extra += ["--config", str(write_tenant_config(workdir / "tenants.yaml"))]
    if name.startswith("tenants-redis"):
        redis, redis_url = start_redis()
        extra += ["--redis-url", redis_url]
    router_args = ["--host", "127.0.0.1", "--port", "0", "--served-model-name", MODEL,
                   "--workers", ",".join(addresses), "--log-level", "warning", *extra]  # fmt: skip
    if stage_times is not None or name.endswith("-deferred"):
        wrapper = [sys.executable, str(ROOT / "gateway_instrumented.py")]
        if stage_times is not None:
            wrapper += ["--stage-times", str(stage_times)]
        if name.endswith("-deferred"):
            wrapper.append("--defer-settlement")
        cmd = [*wrapper, "--", *router_args]
    else:
        cmd = [sys.executable, "-m", "kvflow.cli.main", "router", *router_args]
    gateway, line = start(cmd, "KVFLOW_ROUTER_READY")
    url = f"http://127.0.0.1:{line.split('port=')[1]}"
    return GatewayArm(name, url, gateway, redis, is_instrumented=stage_times is not None)
