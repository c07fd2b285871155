"""What an autoscaling run scores (pure): attainment, replica-hours, churn, recovery.

- **SLO attainment**: the share of requests whose TTFT and TPOT both met their targets
  (a failed request missed them, a request admission control refused too). A pool
  exactly at a p90 SLO attains 90 %.
- **replica-hours**: pods holding a GPU (starting, serving or draining: a starting pod has
  its GPU already), integrated over the run from the 5 s samples.
- **scale events per hour**: changes of the desired replicas.
- **recovery time** (step traffic): from the step up to the end of the last 30 s bucket
  (by arrival) in the high phase whose requests met the SLO less than `percentile` % of
  the time; 0 when none missed it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.loadgen.records import RequestRecord
from kvflow.sim.autoscale import SAMPLE_EVERY_S, ReplicaSample, RunResult, Slo

BUCKET_S = 30.0


@dataclass(frozen=True)
class Score:
    arm: str
    shape: str
    startup_s: float
    num_requests: int
    attainment: float
    replica_hours: float
    scale_events_per_hour: float
    recovery_s: float | None  # step traffic only
    max_replicas: int
    num_refused: int = 0  # answered 429/503 by admission control


@dataclass(frozen=True)
class Bucket:
    start_s: float
    num_requests: int
    attainment: float | None
    ttft_p90_s: float | None
    tpot_p90_s: float | None


def replica_hours(samples: Sequence[ReplicaSample], every_s: float = SAMPLE_EVERY_S) -> float:
    return sum(s.holding for s in samples) * every_s / 3600


def _p(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


def buckets(records: Sequence[RequestRecord], slo: Slo, duration_s: float) -> list[Bucket]:
    num = max(1, math.ceil(duration_s / BUCKET_S))
    groups: list[list[RequestRecord]] = [[] for _ in range(num)]
    for r in records:
        groups[min(num - 1, int(r.sent_s // BUCKET_S))].append(r)
    out = []
    for i, group in enumerate(groups):
        ttfts = [r.ttft_s for r in group if r.ttft_s is not None]
        tpots = [r.tpot_s for r in group if r.tpot_s is not None]
        met = sum(slo.is_met(r) for r in group)
        out.append(
            Bucket(
                start_s=i * BUCKET_S,
                num_requests=len(group),
                attainment=met / len(group) if group else None,
                ttft_p90_s=_p(ttfts, slo.percentile),
                tpot_p90_s=_p(tpots, slo.percentile),
            )
        )
    return out


def recovery_s(series: Sequence[Bucket], slo: Slo, step_up_s: float, step_down_s: float) -> float:
    missed = [
        b
        for b in series
        if step_up_s <= b.start_s < step_down_s
        and b.attainment is not None
        and b.attainment < slo.percentile / 100
    ]
    return max(b.start_s + BUCKET_S for b in missed) - step_up_s if missed else 0.0


def score(result: RunResult, slo: Slo) -> Score:
    records = result.records
    traffic = result.traffic
    met = sum(slo.is_met(r) for r in records)
    recovery = None
    if traffic.step_times_s is not None:
        up, down = traffic.step_times_s
        recovery = recovery_s(buckets(records, slo, traffic.duration_s), slo, up, down)
    return Score(
        arm=result.arm,
        shape=traffic.shape,
        startup_s=result.startup_s,
        num_requests=len(records),
        attainment=met / len(records) if records else 0.0,
        replica_hours=replica_hours(result.replicas),
        scale_events_per_hour=result.num_scale_events / (traffic.duration_s / 3600),
        recovery_s=recovery,
        max_replicas=max((s.holding for s in result.replicas), default=0),
        num_refused=sum(r.error in ("http_429", "http_503") for r in records),
    )
