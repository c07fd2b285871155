"""One autoscaling run in virtual time: traffic, an elastic cluster, a policy on a timer.

The policy decides every `policy.interval_s` from a scrape of the cluster
(`autoscale_observe.sample`); the cluster adds workers that serve after the start-up
delay and drains the ones it removes (`autoscale_cluster`). Every 5 s the run notes the
replicas (desired, ready, holding a GPU) for replica-hours and the plot. The requests are
the same for every arm of one traffic and seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.records import RequestRecord
from kvflow.router.serving.admission import AdmissionConfig
from kvflow.sim.arms import resolve_arm
from kvflow.sim.autoscale_cluster import ElasticCluster
from kvflow.sim.autoscale_observe import sample
from kvflow.sim.autoscale_policies import Policy
from kvflow.sim.autoscale_traffic import Traffic, arrival_times_s, requests_for
from kvflow.sim.cluster import ClusterSpec

SAMPLE_EVERY_S = 5.0
# The scrape's window: the planner's p90 over 30 s holds 150 requests at 5 requests/s.
MIN_WINDOW_S = 30.0


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    percentile: float = 90.0

    def is_met(self, record: RequestRecord) -> bool:
        if record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        return record.tpot_s is None or record.tpot_s <= self.tpot_s


@dataclass(frozen=True)
class ReplicaSample:
    time_s: float
    desired: int
    ready: int
    holding: int  # pods holding a GPU: starting, serving, draining


@dataclass(frozen=True)
class DecisionLog:
    time_s: float
    replicas: int
    reason: str


@dataclass(frozen=True)
class RunResult:
    arm: str
    traffic: Traffic
    startup_s: float
    records: list[RequestRecord]
    replicas: list[ReplicaSample]
    decisions: list[DecisionLog]
    num_scale_events: int


def run(
    profile: SimProfile,
    traffic: Traffic,
    policy: Policy,
    *,
    startup_s: float,
    slo: Slo,
    seed: int = 0,
    admission: AdmissionConfig | None = None,
) -> RunResult:
    """`admission`: the gateway's admission control (None: every request is placed)."""
    cluster = ElasticCluster(
        ClusterSpec(profile, num_workers=policy.initial_replicas(), admission=admission),
        resolve_arm("kvflow"),
        startup_s=startup_s,
        seed=seed,
    )
    rng = random.Random(f"{seed}/{traffic.shape}")
    times = arrival_times_s(traffic, rng)
    for request, at_s in requests_for(times, traffic, rng, f"{traffic.shape}{seed}"):
        cluster.submit(request, at_s)
    replicas, decisions = drive(cluster, policy, slo, traffic.duration_s)
    records = cluster.run()
    return RunResult(
        arm=policy.name,
        traffic=traffic,
        startup_s=startup_s,
        records=records,
        replicas=replicas,
        decisions=decisions,
        num_scale_events=cluster.num_scale_events,
    )


def drive(
    cluster: ElasticCluster, policy: Policy, slo: Slo, duration_s: float
) -> tuple[list[ReplicaSample], list[DecisionLog]]:
    """Put the policy on the cluster's clock: a decision every `policy.interval_s` and a
    replica note every SAMPLE_EVERY_S until `duration_s`. The lists fill as the cluster
    runs."""
    replicas: list[ReplicaSample] = []
    decisions: list[DecisionLog] = []
    window_s = max(MIN_WINDOW_S, policy.interval_s)
    events = cluster.events

    def decide() -> None:
        scrape = sample(
            cluster,
            window_s=window_s,
            percentile_pct=slo.percentile,
            ttft_target_s=slo.ttft_s,
            tpot_target_s=slo.tpot_s,
        )
        wanted, reason = policy.decide(scrape)
        cluster.scale_to(wanted)
        decisions.append(DecisionLog(events.now_s, wanted, reason))
        if events.now_s + policy.interval_s < duration_s:
            events.after(policy.interval_s, decide)

    def note() -> None:
        replicas.append(
            ReplicaSample(
                events.now_s, cluster.num_desired, cluster.num_ready, cluster.num_holding_gpus
            )
        )
        if events.now_s + SAMPLE_EVERY_S < duration_s:
            events.after(SAMPLE_EVERY_S, note)

    events.at(policy.interval_s, decide)
    events.at(0.0, note)
    return replicas, decisions
