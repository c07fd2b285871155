"""Start real `kvflow router` processes for tests, on free ports, always cleaned up."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import httpx

from testkit.process import KvflowProcess, launch_kvflow

READY_PREFIX = "KVFLOW_ROUTER_READY"


class GatewayProcess(KvflowProcess):
    @property
    def port(self) -> int:
        return int(self.ready_fields()["port"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What the openai client takes."""
        return f"{self.url}/v1"

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


def launch_gateway(
    args: Sequence[str], *, timeout_s: float = 90.0, env: Mapping[str, str] | None = None
) -> GatewayProcess:
    """Start `kvflow router --host 127.0.0.1 --port 0 ARGS` and wait for its ready line;
    ``env`` adds to the inherited environment."""
    started = launch_kvflow(
        ["router", "--host", "127.0.0.1", "--port", "0", *args],
        ready_prefix=READY_PREFIX,
        timeout_s=timeout_s,
        env=env,
    )
    return GatewayProcess(started.proc, started.ready_line, started.output)


@contextmanager
def running_gateway(args: Sequence[str], *, timeout_s: float = 90.0) -> Iterator[GatewayProcess]:
    gateway = launch_gateway(args, timeout_s=timeout_s)
    try:
        yield gateway
    finally:
        gateway.stop()
