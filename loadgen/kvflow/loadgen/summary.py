"""One load point's whole result: latency, throughput, whether the schedule held, caching.

A run is **invalid** when the load generator could not keep its schedule: its sends
lagged the schedule by more than ``max_lag_s`` at P99, or it sent at less than
``min_rate_fraction`` of the schedule's own rate over the same requests (a Poisson
schedule's sample rate differs from its nominal rate by chance, so the two are compared
request for request). An invalid point's latencies describe a lighter load than the one
it claims; the report says so and the knee skips it. Closed loop has no schedule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.loadgen.arrivals import LoadPoint, mean_rate_per_s
from kvflow.loadgen.metrics import (
    LatencySummary,
    Percentiles,
    Slo,
    ThroughputSummary,
    is_measured,
    latency_summary,
    percentiles,
    throughput_summary,
)
from kvflow.loadgen.records import RequestRecord


@dataclass(frozen=True, slots=True)
class ScheduleLimits:
    # A 20 ms late send is small next to TTFTs of 100 ms and more, and well above asyncio's
    # timer jitter (about 1 ms); a generator that is 20 ms late at P99 is falling behind.
    max_lag_s: float = 0.020
    min_rate_fraction: float = 0.95


@dataclass(frozen=True)
class ScheduleSummary:
    offered_rate_per_s: float | None  # the load asked for (None in closed loop)
    scheduled_rate_per_s: float | None  # the measured requests' schedule
    achieved_rate_per_s: float  # the measured requests' actual sends
    lag_s: Percentiles
    is_valid: bool
    problems: tuple[str, ...]


@dataclass(frozen=True)
class CacheSummary:
    # Sum of usage.prompt_tokens_details.cached_tokens over sum of prompt tokens, for the
    # successful requests whose server reported it.
    hit_rate: float | None
    num_reporting: int
    # What kvflow's router expected (x-kvflow-route's prefix blocks x block size).
    router_hit_rate: float | None
    requests_per_worker: dict[str, int]
    # Max over mean requests per worker seen; 1.0 is perfect balance.
    load_imbalance: float | None
    # Successful requests by where they went relative to their prompt's best holder
    # (kvflow.proto.prefix_outcome), where the router said: why the hit rate is what it is.
    prefix_outcomes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadPointSummary:
    label: str
    kind: str
    value: float
    num_warmup: int
    latency: LatencySummary
    throughput: ThroughputSummary
    schedule: ScheduleSummary
    cache: CacheSummary
    meets_ttft_slo: bool

    @property
    def qps(self) -> float:
        """Where the point sits on a latency-vs-QPS axis: the offered rate, else achieved."""
        offered = self.schedule.offered_rate_per_s
        return offered if offered is not None else self.schedule.achieved_rate_per_s


def schedule_summary(
    records: Sequence[RequestRecord], offered_rate_per_s: float | None, limits: ScheduleLimits
) -> ScheduleSummary:
    sends = sorted(r.sent_s for r in records)
    achieved = mean_rate_per_s(sends)
    lags = [x for r in records if (x := r.schedule_lag_s) is not None]
    if not lags:  # closed loop
        return ScheduleSummary(None, None, achieved, percentiles(()), True, ())
    scheduled = mean_rate_per_s(sorted(r.scheduled_s for r in records if r.scheduled_s is not None))
    lag = percentiles(lags)
    problems = []
    if lag.p99 is not None and lag.p99 > limits.max_lag_s:
        problems.append(
            f"sends lagged the schedule by {lag.p99 * 1e3:.1f} ms at P99 "
            f"(limit {limits.max_lag_s * 1e3:g} ms): the load generator fell behind"
        )
    if scheduled > 0 and achieved < limits.min_rate_fraction * scheduled:
        problems.append(
            f"sent {achieved:.2f} req/s against a schedule of {scheduled:.2f} req/s "
            f"(below {limits.min_rate_fraction:.0%})"
        )
    return ScheduleSummary(
        offered_rate_per_s, scheduled, achieved, lag, not problems, tuple(problems)
    )


def cache_summary(records: Sequence[RequestRecord], block_size: int) -> CacheSummary:
    ok = [r for r in records if r.is_ok and r.num_prompt_tokens]
    reporting = [r for r in ok if r.num_cached_tokens is not None]
    prompt_total = sum(r.num_prompt_tokens or 0 for r in reporting)
    hit_rate = (
        sum(r.num_cached_tokens or 0 for r in reporting) / prompt_total if prompt_total else None
    )
    routed = [r for r in ok if r.predicted_cached_blocks is not None]
    routed_total = sum(r.num_prompt_tokens or 0 for r in routed)
    predicted = sum(
        min((r.predicted_cached_blocks or 0) * block_size, r.num_prompt_tokens or 0) for r in routed
    )
    per_worker = Counter(r.worker for r in records if r.worker is not None)
    imbalance = (
        max(per_worker.values()) * len(per_worker) / sum(per_worker.values())
        if per_worker
        else None
    )
    outcomes = Counter(r.prefix_outcome for r in ok if r.prefix_outcome is not None)
    return CacheSummary(
        hit_rate=hit_rate,
        num_reporting=len(reporting),
        router_hit_rate=predicted / routed_total if routed_total else None,
        requests_per_worker=dict(sorted(per_worker.items())),
        load_imbalance=imbalance,
        prefix_outcomes=dict(sorted(outcomes.items())),
    )


def summarize(
    point: LoadPoint,
    records: Sequence[RequestRecord],
    *,
    warmup_s: float,
    offered_rate_per_s: float | None,
    slo: Slo,
    limits: ScheduleLimits = ScheduleLimits(),
    block_size: int = 16,
    closed_window_s: tuple[float, float] | None = None,
) -> LoadPointSummary:
    """``closed_window_s``: a closed loop's measuring window (from, to), in which its rates
    are counted as completions (metrics.throughput_summary says why)."""
    measured = [r for r in records if is_measured(r, warmup_s)]
    completed = None
    if closed_window_s is not None:
        start_s, end_s = closed_window_s
        completed = ([r for r in records if start_s <= r.end_s <= end_s], end_s - start_s)
    latency = latency_summary(measured)
    schedule = schedule_summary(measured, offered_rate_per_s, limits)
    p90 = latency.ttft_p90_with_failures_s
    return LoadPointSummary(
        label=point.label,
        kind=point.kind.value,
        value=point.value,
        num_warmup=len(records) - len(measured),
        latency=latency,
        throughput=throughput_summary(measured, slo, completed),
        schedule=schedule,
        cache=cache_summary(measured, block_size),
        meets_ttft_slo=schedule.is_valid and p90 is not None and p90 <= slo.ttft_s,
    )


def knee(points: Sequence[LoadPointSummary]) -> LoadPointSummary | None:
    """The highest-QPS point whose TTFT P90 (failures counted as misses) meets the SLO and
    whose schedule held; None when no point does."""
    meeting = [p for p in points if p.meets_ttft_slo]
    return max(meeting, key=lambda p: p.qps) if meeting else None
