"""Several simulated workers in one process: for clusters of dozens on a small machine.

Each worker is what `kvflow worker --simulate` serves: its own engine (scheduler, block
pool, prefix cache, KV events) on its own thread, its own gRPC server and port, its own
instance id, so a router sees N independent workers. They share one asyncio loop and one
interpreter. Sizing: a `kvflow worker --simulate` process holds about 550 MB of RSS (its
KV transfer agent imports torch for gloo) and takes 2 s of CPU to start, so 64 of them
would need 35 GB on a 24 GiB machine; without the agent, 4 hosts of 16 hold about 195 MB
together (the scale check, docs/benchmarks.md). A step's time passes in
``time.sleep`` on the worker's thread, which releases the GIL, so workers of one host
overlap their steps as separate processes would; their Python work (scheduling, streaming)
shares one core's worth of GIL, which is what the load of a scale test must stay under.

Not served here: the KV transfer agent (no PD: roles other than ``colocated`` are refused),
the per-worker HTTP /metrics port, draining. Run as a process:

    python -m kvflow.engine_worker.sim.host --num-workers 16 --sim-profile h100-llama3-8b \
        --num-kv-blocks 512

takes every `kvflow worker` flag (``--simulate`` is implied; ``--port`` is the first
worker's port, the others follow it, 0 picks free ports) and prints
``KVFLOW_SIM_HOST_READY grpc_ports=P1,P2,...`` once every worker serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.engine_loop import EngineLoop
from kvflow.engine_worker.server import WorkerService
from kvflow.engine_worker.settings import WorkerSettings, parse_args
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.proto.roles import Role

log = logging.getLogger("kvflow.sim.host")

READY_PREFIX = "KVFLOW_SIM_HOST_READY"
# 64 workers on 4 hosts is the scale check's shape; more per host only adds GIL contention.
MAX_WORKERS_PER_HOST = 256


@dataclass(frozen=True)
class HostSettings:
    num_workers: int
    worker: WorkerSettings


def parse_host_args(argv: Sequence[str]) -> HostSettings:
    p = argparse.ArgumentParser(
        prog="python -m kvflow.engine_worker.sim.host",
        description="Serve several simulated workers from one process (one port each).",
        add_help=False,
    )
    p.add_argument("--num-workers", type=int, default=1)
    own, rest = p.parse_known_args(list(argv))
    if not 1 <= own.num_workers <= MAX_WORKERS_PER_HOST:
        raise SystemExit(f"--num-workers must be 1..{MAX_WORKERS_PER_HOST}, got {own.num_workers}")
    worker = parse_args([*rest, *(["--simulate"] if "--simulate" not in rest else [])])
    if worker.role is not Role.COLOCATED:
        raise SystemExit(
            "a simulated host serves colocated workers only (--role colocated): it runs no KV "
            "transfer agent; start `kvflow worker --simulate` processes for PD"
        )
    return HostSettings(own.num_workers, worker)


@dataclass
class _Hosted:
    loop: EngineLoop
    server: grpc.aio.Server
    port: int


async def _start_one(settings: WorkerSettings, port: int) -> _Hosted:
    built = build_worker(settings)
    loop = EngineLoop(built.engine)
    loop.start()
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(
        WorkerService(loop, built.info, built.runner.kv_layout), server
    )
    bound = server.add_insecure_port(f"{settings.host}:{port}")
    await server.start()
    return _Hosted(loop, server, bound)


async def serve(host: HostSettings) -> None:
    hosted: list[_Hosted] = []
    base_port = host.worker.port
    try:
        for i in range(host.num_workers):
            hosted.append(await _start_one(host.worker, base_port + i if base_port else 0))
        ports = ",".join(str(h.port) for h in hosted)
        log.info("serving %d simulated workers on ports %s", len(hosted), ports)
        print(f"{READY_PREFIX} grpc_ports={ports}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await asyncio.gather(*(h.server.stop(grace=1.0) for h in hosted))
        for h in hosted:
            h.loop.stop()


def main(argv: Sequence[str] | None = None) -> int:
    host = parse_host_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        asyncio.run(serve(host))
    except OSError as exc:  # most often: a port is taken
        print(f"kvflow sim host: {exc}; pick another --port (or 0)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
