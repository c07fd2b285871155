"""The soak's cluster of real processes: a redis-server, simulated workers, one real engine
worker on the built-in model, and two gateway (router) replicas, each on a fixed loopback
port so that a part killed with SIGKILL comes back at the same address, as a pod behind a
Service would.

Every part is a `Part`: start it, SIGKILL it, start it again; the soak's chaos loop only
ever sees that interface.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
import httpx
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
from testkit.process import KvflowProcess
from testkit.redis_server import RedisServer
from testkit.worker_process import launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.router.tenants.config import hash_api_key

T = TypeVar("T")

MODEL = "chaos"
SIM_STEP_MS = 5
SIM_KV_BLOCKS = 1024
REAL_KV_BLOCKS = 512
# Short enough that a worker killed before its first token fails over within the soak's
# request deadline, long enough for the real CPU worker on two busy cores.
FIRST_TOKEN_TIMEOUT_S = 10.0
TOKEN_STALL_TIMEOUT_S = 10.0

# name -> quotas. "bursty" has a low request rate, so 429s are part of the mix.
TENANT_QUOTAS: dict[str, dict[str, int]] = {
    "acme": {"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000},
    "globex": {"max_concurrent_requests": 8, "daily_token_budget": 100_000_000},
    "bursty": {"requests_per_minute": 30},
}


# Sends only at checkpoints, when nothing else does: its usage counters must be exact.
AUDIT_TENANT = "audit"


def api_key(tenant: str) -> str:
    return f"sk-chaos-{tenant}-0123456789abcdef"


@dataclass
class Part:
    """One process the chaos loop may kill; `start` brings it back at the same address."""

    name: str
    kind: str  # "worker", "real-worker", "router", "redis"
    _start: Callable[[], KvflowProcess | RedisServer]
    proc: KvflowProcess | RedisServer | None = None
    kills: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.proc = self._start()

    @property
    def alive(self) -> bool:
        p = self.proc
        if isinstance(p, RedisServer):
            return p.proc is not None and p.proc.poll() is None
        return p is not None and p.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye, as when a node dies."""
        p = self.proc
        popen = p.proc if p is not None else None
        if popen is not None and popen.poll() is None:
            popen.send_signal(signal.SIGKILL)
            popen.wait(timeout=30)
        self.kills += 1

    def stop(self) -> None:
        p = self.proc
        if isinstance(p, RedisServer):
            p.stop()
        elif p is not None:
            p.stop(sig=signal.SIGKILL, timeout_s=10)

    def log(self) -> str:
        p = self.proc
        return p.log if isinstance(p, KvflowProcess) else ""


@dataclass
class Cluster:
    workdir: Path
    num_sim_workers: int = 3
    with_real_worker: bool = True
    parts: list[Part] = field(default_factory=list)
    redis_port: int = field(default_factory=free_port)
    router_ports: list[int] = field(default_factory=lambda: [free_port(), free_port()])
    worker_ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        redis = RedisServer(self.redis_port)

        def start_redis() -> RedisServer:
            redis.proc = None
            redis.start()
            return redis

        self.parts.append(Part("redis", "redis", start_redis))
        names = [f"sim-{i}" for i in range(self.num_sim_workers)]
        if self.with_real_worker:
            names.append("real-0")
        for name in names:
            self.worker_ports[name] = free_port()
            kind = "real-worker" if name.startswith("real") else "worker"
            self.parts.append(Part(name, kind, self._worker_starter(name)))
        config = self.workdir / "router.yaml"
        tenants = [
            {"name": t, "api_key_sha256": hash_api_key(api_key(t)), **q}
            for t, q in {**TENANT_QUOTAS, AUDIT_TENANT: {}}.items()
        ]
        config.write_text(yaml.safe_dump({"tenants": tenants}))
        for i, port in enumerate(self.router_ports):
            self.parts.append(Part(f"router-{i}", "router", self._router_starter(port, config)))

    def _worker_starter(self, name: str) -> Callable[[], KvflowProcess]:
        port = self.worker_ports[name]
        if name.startswith("real"):
            # The built-in SmolLM2-135M GGUF: the real engine, its real block pool.
            args = ["--served-model-name", MODEL, "--num-kv-blocks", str(REAL_KV_BLOCKS),
                    "--max-num-seqs", "8"]  # fmt: skip
        else:
            args = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms",
                    str(SIM_STEP_MS), "--num-kv-blocks", str(SIM_KV_BLOCKS)]  # fmt: skip
        return lambda: _retrying_bind(
            lambda: launch_worker([*args, "--port", str(port)], timeout_s=180)
        )

    def _router_starter(self, port: int, config: Path) -> Callable[[], GatewayProcess]:
        addresses = ",".join(f"127.0.0.1:{p}" for p in self.worker_ports.values())
        args = ["--served-model-name", MODEL, "--workers", addresses, "--config", str(config),
                "--redis-url", f"redis://127.0.0.1:{self.redis_port}/0",
                "--first-token-timeout-s", str(FIRST_TOKEN_TIMEOUT_S),
                "--token-stall-timeout-s", str(TOKEN_STALL_TIMEOUT_S),
                "--drain-grace-s", "5", "--port", str(port)]  # fmt: skip
        return lambda: _retrying_bind(lambda: launch_gateway(args, timeout_s=180))

    @property
    def router_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.router_ports]

    def by_kind(self, *kinds: str) -> list[Part]:
        return [p for p in self.parts if p.kind in kinds]

    def part(self, name: str) -> Part:
        return next(p for p in self.parts if p.name == name)

    def up(self) -> None:
        """Everything started (in parallel: the machine has two cores, not patience)."""
        self.part("redis").start()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(Part.start, self.by_kind("worker", "real-worker")))
            list(pool.map(Part.start, self.by_kind("router")))
        self.wait_serving()

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Until every router sees every worker healthy."""
        num_workers = len(self.by_kind("worker", "real-worker"))
        for part in self.by_kind("router"):
            assert isinstance(part.proc, GatewayProcess)
            part.proc.wait_ready(num_workers=num_workers, timeout_s=timeout_s)

    def down(self) -> None:
        for part in reversed(self.parts):
            part.stop()

    def worker_loads(self) -> dict[str, pb.LoadResponse]:
        """Each worker's own account of its blocks and requests (gRPC Load)."""
        loads = {}
        for name, port in self.worker_ports.items():
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                loads[name] = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=10)
        return loads

    def logs(self, kinds: Sequence[str] = ("router", "worker", "real-worker")) -> str:
        return "\n".join(f"===== {p.name}\n{p.log()[-4000:]}" for p in self.by_kind(*kinds))


def _retrying_bind(start: Callable[[], T]) -> T:
    """A part restarts at its old port, which a killed process's socket or another
    process's outgoing connection can hold for a moment (a CI run once lost the short soak
    to "Address already in use"): try again a few times before calling it a failure."""
    for attempt in range(5):
        try:
            return start()
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == 4:
                raise
            time.sleep(1.0)
    raise AssertionError("unreachable")


def usage(router_url: str, tenant: str) -> dict[str, object]:
    headers = {"authorization": f"Bearer {api_key(tenant)}"}
    r = httpx.get(f"{router_url}/v1/usage", headers=headers, timeout=10)
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(0.2)
