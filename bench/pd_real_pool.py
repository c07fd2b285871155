"""The real processes of `bench/pd_real.py`, and what they cost the machine.

Four `kvflow worker` processes (two `colocated`, one `prefill`, one `decode`) start once; each
arm is a `kvflow router` gateway over two of them, so every arm runs on exactly two worker
processes and an arm's idle workers only sleep. Each worker runs torch on **one thread**:
the worker sets no thread count itself (engine_worker has no such flag), so its
environment does (``OMP_NUM_THREADS=1``; torch sizes its intra-op pool from it at import).

CPU seconds come from ``/proc``: per process (utime + stime of all its threads) and for
the whole machine, so a run says how much CPU other jobs on the machine took from it.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.process import KvflowProcess
from testkit.worker_process import WorkerProcess, launch_worker

MODEL_NAME = "smollm2"
# MKL too, in case a torch build uses it for some ops; KMP/OpenBLAS follow OMP.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
WORKER_ROLES = {
    "colocated-0": "colocated",
    "colocated-1": "colocated",
    "prefill": "prefill",
    "decode": "decode",
}
_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Arm:
    name: str
    workers: tuple[str, ...]  # keys of WORKER_ROLES
    # The router's `disaggregation:` section; None: the router's defaults.
    disaggregation: Mapping[str, object] | None = None


@dataclass
class Pool:
    workers: dict[str, WorkerProcess]
    gateways: dict[str, GatewayProcess] = field(default_factory=dict)

    def pids(self, arm: Arm) -> dict[str, int]:
        pids = {w: self.workers[w].proc.pid for w in arm.workers}
        return {**pids, "gateway": self.gateways[arm.name].proc.pid, "client": os.getpid()}


def _config_yaml(disaggregation: Mapping[str, object] | None) -> str:
    return yaml.safe_dump({"disaggregation": dict(disaggregation)} if disaggregation else {})


@contextmanager
def running_pool(
    arms: Sequence[Arm], *, model: str | None, kv_cache_gib: float, kv_transport: str
) -> Iterator[Pool]:
    """Start the four workers (in parallel) and one gateway per arm; stop them all after."""
    common = ["--served-model-name", MODEL_NAME, "--kv-cache-gib", str(kv_cache_gib),
              "--kv-transport", kv_transport, *(["--model", model] if model else [])]  # fmt: skip
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pd-real-") as tmp:
        with ThreadPoolExecutor(len(WORKER_ROLES)) as starter:
            futures = {
                name: starter.submit(
                    launch_worker, [*common, "--role", role], timeout_s=300, env=WORKER_ENV
                )
                for name, role in WORKER_ROLES.items()
            }
        workers: dict[str, WorkerProcess] = {}
        for name, future in futures.items():
            if future.exception() is None:
                workers[name] = future.result()
                stack.callback(workers[name].stop, timeout_s=10)
        failed = {n: f.exception() for n, f in futures.items() if f.exception() is not None}
        if failed:
            raise RuntimeError(f"workers failed to start: {failed}")
        pool = Pool(workers)
        for arm in arms:
            config = Path(tmp) / f"{arm.name}.yaml"
            config.write_text(_config_yaml(arm.disaggregation))
        with ThreadPoolExecutor(len(arms)) as starter:
            started = {arm.name: starter.submit(_start_gateway, arm, workers, Path(tmp))
                       for arm in arms}  # fmt: skip
        for name, future in started.items():
            if future.exception() is None:
                pool.gateways[name] = future.result()
                stack.callback(pool.gateways[name].stop)
        failed = {n: f.exception() for n, f in started.items() if f.exception() is not None}
        if failed:
            raise RuntimeError(f"gateways failed to start: {failed}")
        # Runs first: every process gets SIGTERM before the stops above wait for each.
        stack.callback(_signal_all, [*pool.gateways.values(), *workers.values()])
        yield pool


def _signal_all(processes: Sequence[KvflowProcess]) -> None:
    """SIGTERM without waiting, so nine processes that take a second each to drain and exit
    stop in about one second, not nine."""
    for process in processes:
        if process.proc.poll() is None:
            process.proc.send_signal(signal.SIGTERM)


def _start_gateway(arm: Arm, workers: Mapping[str, WorkerProcess], tmp: Path) -> GatewayProcess:
    addresses = ",".join(workers[w].address for w in arm.workers)
    gateway = launch_gateway(["--served-model-name", MODEL_NAME, "--workers", addresses,
                              "--config", str(tmp / f"{arm.name}.yaml"), "--seed", "0",
                              "--log-level", "warning"])  # fmt: skip
    try:
        gateway.wait_ready(num_workers=len(arm.workers))
    except BaseException:
        gateway.stop()
        raise
    return gateway


# -- what a run cost ------------------------------------------------------------------------


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S  # utime, stime


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (every core; idle and iowait out)."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS_PER_S


@dataclass(frozen=True)
class CpuSnapshot:
    wall_s: float
    machine_busy_s: float
    per_process_s: Mapping[str, float]
    load_avg_1m: float


def cpu_snapshot(pids: Mapping[str, int]) -> CpuSnapshot:
    return CpuSnapshot(
        wall_s=time.monotonic(),
        machine_busy_s=machine_cpu_s(),
        per_process_s={name: process_cpu_s(pid) for name, pid in pids.items()},
        load_avg_1m=os.getloadavg()[0],
    )


def cpu_usage(before: CpuSnapshot, after: CpuSnapshot) -> dict[str, object]:
    """CPU seconds each process used between two snapshots, the machine's busy seconds,
    and the rest: what other jobs on the machine used meanwhile."""
    ours = {n: round(after.per_process_s[n] - before.per_process_s[n], 2)
            for n in before.per_process_s}  # fmt: skip
    busy_s = after.machine_busy_s - before.machine_busy_s
    return {
        "wall_s": round(after.wall_s - before.wall_s, 2),
        "num_cores": os.cpu_count(),
        "machine_busy_cpu_s": round(busy_s, 2),
        "process_cpu_s": ours,
        "other_jobs_cpu_s": round(busy_s - sum(ours.values()), 2),
        "load_avg_1m": [round(before.load_avg_1m, 2), round(after.load_avg_1m, 2)],
    }


# -- what the workers and the gateway say ---------------------------------------------------


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus endpoint, keyed ``name{label=value,...}``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


PD_PREFIXES = ("kvflow_router_pd_decisions_total", "kvflow_router_pd_transfers_total",
               "kvflow_router_pd_failures_total", "kvflow_router_pd_transfer_seconds_sum",
               "kvflow_router_pd_transfer_seconds_count", "kvflow_router_pd_transfer_bytes_total",
               "kvflow_router_failovers_total")  # fmt: skip


def pd_counters(gateway: GatewayProcess) -> dict[str, float]:
    return {k: v for k, v in scrape(gateway.url).items() if k.startswith(PD_PREFIXES)}


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What grew between two scrapes (counters that did not move are left out)."""
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()
            if v - before.get(k, 0.0) > 0}  # fmt: skip


def wait_idle(workers: Sequence[WorkerProcess], timeout_s: float = 60.0) -> bool:
    """Until no worker has a request running or waiting; False when that never came."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for w in workers:
            m = scrape(f"http://127.0.0.1:{w.metrics_port}")
            # Every class's series: the gauges carry a priority_class label.
            busy += sum(v for k, v in m.items() if k.startswith("kvflow_worker_requests_running"))
            busy += sum(v for k, v in m.items() if k.startswith("kvflow_worker_requests_waiting"))
        if busy == 0:
            return True
        time.sleep(0.5)
    return False
