"""The chaos soak: mixed load through two real gateway replicas to simulated workers and a
real engine worker, while a seeded chaos loop SIGKILLs and restarts workers, routers and
Redis at random; then quiescence, and the books are checked.

The run is a series of rounds. In a round, clients send requests and the chaos loop kills
things. Between rounds (and at the end) comes a checkpoint: chaos and load stop, every
part is back, and then
- every worker's block pool must be whole again (free blocks == total, nothing running):
  a block still held is a leak;
- a quiet audit tenant sends a known set of requests through both replicas: the cluster's
  usage counters must move by exactly those requests and tokens (counted twice, or not
  at all, is a bug).

What counts as bad is listed in `SoakReport.bad`: the targets are zero.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from chaos.cluster import AUDIT_TENANT, Cluster, Part, api_key, usage, wait_for
from chaos.load import LoadClient, Spec, Tally, run_clients


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 40.0
    seed: int = 0
    num_clients: int = 4
    num_sim_workers: int = 3
    with_real_worker: bool = True
    mean_fault_interval_s: float = 4.0
    max_down_s: float = 4.0  # a killed part stays down up to this long
    round_s: float = 300.0  # chaos and load between checkpoints
    # The last part of each round kills no worker: a block leaked by a request cut or
    # abandoned then is still there at the checkpoint (a restarted worker starts afresh).
    calm_fraction: float = 0.35
    kinds: tuple[str, ...] = ("worker", "real-worker", "router", "redis")


@dataclass
class Downtime:
    part: str
    kind: str
    down_s: float
    up_s: float = float("inf")


@dataclass
class SoakReport:
    config: dict[str, Any]
    wall_s: float = 0.0
    num_requests: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    client_events: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    kills: dict[str, int] = field(default_factory=dict)
    restart_failures: list[str] = field(default_factory=list)
    leaked_blocks: dict[str, int] = field(default_factory=dict)  # worker -> blocks held
    usage_audit_problems: list[str] = field(default_factory=list)
    checkpoint_errors: list[str] = field(default_factory=list)
    unexpected_exits: list[str] = field(default_factory=list)  # died, not killed
    duplicate_response_ids: int = 0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    load_average: list[float] = field(default_factory=list)
    checkpoints: int = 0
    kubernetes_objects_duplicated: str = "not exercised (operator not in this soak)"

    def bad(self) -> dict[str, int]:
        """Everything whose target is zero."""
        counts = {k: v for k, v in self.verdicts.items() if k.startswith("bad:")}
        counts["leaked-blocks"] = sum(self.leaked_blocks.values())
        counts["usage-audit-problems"] = len(self.usage_audit_problems)
        counts["duplicate-response-ids"] = self.duplicate_response_ids
        counts["restart-failures"] = len(self.restart_failures)
        counts["checkpoint-errors"] = len(self.checkpoint_errors)
        counts["unexpected-exits"] = len(self.unexpected_exits)
        return {k: v for k, v in counts.items() if v}

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bad": self.bad()}


class ChaosLoop:
    """Seeded kills and restarts; remembers when each part was down."""

    def __init__(self, cluster: Cluster, config: SoakConfig, report: SoakReport) -> None:
        self.cluster, self.config, self.report = cluster, config, report
        self.rng = random.Random(config.seed)
        self.downtimes: list[Downtime] = []
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._restarts: list[threading.Thread] = []
        # The first faults take one part of each kind, in seeded order: even a short run
        # kills every kind at least once.
        self._first_kinds = list(config.kinds)
        self.rng.shuffle(self._first_kinds)
        self.calm = False  # workers are spared while True
        self.closing = False

    def killed_during(self, kind: str, t0_s: float, t1_s: float) -> bool:
        """Was a part of ``kind`` ("worker" includes the real one) down during [t0, t1]?"""
        with self._lock:
            return any(kind in d.kind and d.down_s <= t1_s and d.up_s >= t0_s - 1.0
                       for d in self.downtimes)  # fmt: skip

    def _candidates(self) -> list[Part]:
        with self._lock:
            down = set(self._down)
        routers_down = any(n.startswith("router") for n in down)
        kinds = [k for k in self.config.kinds if not (self.calm and "worker" in k)]
        return [p for p in self.cluster.by_kind(*kinds) if p.name not in down
                and not (p.kind == "router" and routers_down)]  # fmt: skip

    def find_unexpected_exits(self) -> None:
        """A part that died without being killed is a bug: note it, and bring it back."""
        with self._lock:
            down = set(self._down)
        for part in self.cluster.parts:
            if part.name not in down and part.proc is not None and not part.alive:
                self.report.unexpected_exits.append(f"{part.name}: {part.log()[-1500:]}")
                downtime = Downtime(part.name, part.kind, time.monotonic())
                with self._lock:
                    self._down.add(part.name)
                    self.downtimes.append(downtime)
                thread = threading.Thread(target=self._restart, args=(part, 0.0, downtime))
                thread.start()
                self._restarts.append(thread)

    def fault(self) -> None:
        self.find_unexpected_exits()
        candidates = self._candidates()
        if not candidates:
            return
        if self._first_kinds:
            of_kind = [p for p in candidates if p.kind == self._first_kinds[0]]
            if of_kind:  # else a router is down already: this kind comes next time
                self._first_kinds.pop(0)
                candidates = of_kind
        part = self.rng.choice(candidates)
        delay_s = self.rng.uniform(0.2, self.config.max_down_s)
        downtime = Downtime(part.name, part.kind, time.monotonic())
        with self._lock:
            self._down.add(part.name)
            self.downtimes.append(downtime)
        part.kill()
        self.report.kills[part.name] = self.report.kills.get(part.name, 0) + 1
        thread = threading.Thread(target=self._restart, args=(part, delay_s, downtime))
        thread.start()
        self._restarts.append(thread)

    def _restart(self, part: Part, delay_s: float, downtime: Downtime) -> None:
        time.sleep(delay_s)
        for attempt in range(3):
            if self.closing:  # the soak is ending: start nothing that would outlive it
                break
            try:
                part.start()
                break
            except (RuntimeError, TimeoutError) as exc:
                self.report.restart_failures.append(f"{part.name} try {attempt}: {exc}"[:300])
                time.sleep(1.0)
        with self._lock:
            downtime.up_s = time.monotonic()
            self._down.discard(part.name)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            wait_s = self.rng.expovariate(1.0 / self.config.mean_fault_interval_s)
            try:
                await asyncio.wait_for(stop.wait(), timeout=wait_s)
            except TimeoutError:
                await asyncio.to_thread(self.fault)

    def join(self) -> None:
        for thread in self._restarts:
            thread.join()
        self._restarts.clear()


def check_blocks(cluster: Cluster, report: SoakReport, timeout_s: float = 30.0) -> None:
    """After quiescence every worker's pool is whole: free == total, nothing running."""
    deadline = time.monotonic() + timeout_s
    while True:
        loads = cluster.worker_loads()
        held = {name: load.num_total_blocks - load.num_free_blocks + load.num_running
                + load.num_waiting for name, load in loads.items()}  # fmt: skip
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name, blocks in held.items():
        if blocks:
            report.leaked_blocks[name] = report.leaked_blocks.get(name, 0) + blocks


def audit_usage(cluster: Cluster, report: SoakReport, num_requests: int = 6) -> None:
    """A quiet tenant's known requests move the cluster's counters by exactly their size."""
    urls = cluster.router_urls

    def cluster_scope() -> bool:
        return all(usage(u, AUDIT_TENANT)["scope"] == "cluster" for u in urls)

    # A router finds Redis again on its next call to it, after its retry delay.
    wait_for(cluster_scope, 60, "both routers back on Redis")
    before = usage(urls[0], AUDIT_TENANT)
    sent = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
    for i in range(num_requests):
        spec = Spec(AUDIT_TENANT, chat=i % 2 == 0, stream=False, max_tokens=3 + i,
                    prompt=f"audit {i} " * (1 + i))  # fmt: skip
        r = httpx.post(f"{urls[i % len(urls)]}/v1/{'chat/' if spec.chat else ''}completions",
                       json=spec.body(), timeout=60,
                       headers={"authorization": f"Bearer {api_key(AUDIT_TENANT)}"})  # fmt: skip
        if r.status_code != 200:
            report.usage_audit_problems.append(f"audit request {i}: {r.status_code} {r.text[:200]}")
            return
        u = r.json()["usage"]
        sent["requests"] += 1
        sent["prompt_tokens"] += u["prompt_tokens"]
        sent["completion_tokens"] += u["completion_tokens"]
    after = usage(urls[1 % len(urls)], AUDIT_TENANT)
    for name, count in sent.items():
        delta = int(after[name]) - int(before[name])  # type: ignore[call-overload]
        if delta != count:
            report.usage_audit_problems.append(f"{name}: counted {delta}, sent {count}")


async def _round(cluster: Cluster, chaos: ChaosLoop, tally: Tally, config: SoakConfig,
                 round_s: float, round_no: int) -> None:  # fmt: skip
    stop = asyncio.Event()
    load = LoadClient(cluster.router_urls, tally, chaos.killed_during)
    clients = asyncio.create_task(run_clients(load, config.num_clients,
                                              config.seed * 100 + round_no, stop))  # fmt: skip
    monkey = asyncio.create_task(chaos.run(stop))
    chaos.calm = False
    await asyncio.sleep(round_s * (1 - config.calm_fraction))
    chaos.calm = True
    await asyncio.sleep(round_s * config.calm_fraction)
    stop.set()
    await monkey
    await asyncio.to_thread(chaos.find_unexpected_exits)
    await asyncio.to_thread(chaos.join)  # every part back before the clients stop
    await clients


def run_soak(config: SoakConfig, workdir: Path, cluster: Cluster | None = None) -> SoakReport:
    report = SoakReport(config=asdict(config))
    cluster = cluster or Cluster(workdir, config.num_sim_workers, config.with_real_worker)
    started = time.monotonic()
    chaos, tally = ChaosLoop(cluster, config, report), Tally()
    cluster.up()
    try:
        loadavg: list[float] = []
        chaos_s, round_no = 0.0, 0
        while chaos_s < config.duration_s:
            round_s = min(config.round_s, config.duration_s - chaos_s)
            asyncio.run(_round(cluster, chaos, tally, config, round_s, round_no))
            loadavg.append(os.getloadavg()[0])
            chaos_s += round_s
            round_no += 1
            try:
                cluster.wait_serving()
                check_blocks(cluster, report)
                audit_usage(cluster, report)
            except (TimeoutError, httpx.HTTPError, grpc.RpcError) as exc:
                report.checkpoint_errors.append(f"round {round_no}: {exc!r}"[:500])
            report.checkpoints += 1
            print(f"chaos soak: round {round_no} done, {chaos_s:.0f} s of chaos, "
                  f"{tally.num_requests} requests, {dict(tally.verdicts)}, kills "
                  f"{report.kills}, leaked {report.leaked_blocks}, load {loadavg[-1]:.1f}",
                  file=sys.stderr, flush=True)  # fmt: skip
        report.num_requests = tally.num_requests
        report.verdicts = dict(tally.verdicts)
        report.client_events = dict(tally.events)
        report.examples = tally.examples
        report.duplicate_response_ids = tally.duplicate_ids()
        lat = sorted(tally.latencies_s) or [0.0]
        report.latency_p50_s = round(lat[len(lat) // 2], 3)
        report.latency_p99_s = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3)
        report.load_average = [round(x, 2) for x in loadavg]
    finally:
        chaos.closing = True
        chaos.join()
        report.wall_s = round(time.monotonic() - started, 1)
        cluster.down()
    return report
