"""From request records to one load point's numbers. Pure: no clock, no I/O.

Definitions (kubernetes-sigs/inference-perf; DistServe for goodput):
- TTFT: first text chunk - send. E2E: last byte - send.
- TPOT: (T_last - T_first) / (O - 1) per request with O >= 2 output tokens.
- ITL: gaps between consecutive text chunks, pooled over requests.
- Goodput: requests per second that met both the TTFT and the TPOT SLO; a request with
  one output token has no TPOT and meets that half trivially; a failure meets neither.
- Percentiles interpolate linearly between order statistics (numpy's default).
Requests scheduled (open loop) or sent (closed loop) during the warm-up are sent but not
measured. Throughput and goodput divide by the measured window: the first measured send
to the last measured end.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvflow.loadgen.records import RequestRecord


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, linearly interpolated."""
    assert sorted_values and 0.0 <= q <= 1.0
    h = (len(sorted_values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (h - lo) * (sorted_values[hi] - sorted_values[lo])


def percentiles(values: Iterable[float]) -> Percentiles:
    data = sorted(values)
    if not data:
        return Percentiles(0)
    return Percentiles(
        count=len(data),
        mean=math.fsum(data) / len(data),
        p50=percentile(data, 0.50),
        p90=percentile(data, 0.90),
        p99=percentile(data, 0.99),
        max=data[-1],
    )


def is_measured(record: RequestRecord, warmup_s: float) -> bool:
    start_s = record.scheduled_s if record.scheduled_s is not None else record.sent_s
    return start_s >= warmup_s


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    ttft_s = record.ttft_s
    if ttft_s is None or ttft_s > slo.ttft_s:
        return False
    tpot_s = record.tpot_s
    return tpot_s is None or tpot_s <= slo.tpot_s


@dataclass(frozen=True)
class LatencySummary:
    ttft_s: Percentiles
    tpot_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    # The TTFT P90 that decides the knee: a failed request counts as an infinite TTFT,
    # so a load point cannot meet the SLO by failing its slow requests. None when that
    # P90 is infinite (more than 10 % failed) or nothing was measured.
    ttft_p90_with_failures_s: float | None


def latency_summary(records: Sequence[RequestRecord]) -> LatencySummary:
    ok = [r for r in records if r.is_ok]
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    with_failures = sorted(ttfts + [math.inf] * (len(records) - len(ttfts)))
    p90 = percentile(with_failures, 0.9) if with_failures else math.inf
    return LatencySummary(
        ttft_s=percentiles(ttfts),
        tpot_s=percentiles(t for r in ok if (t := r.tpot_s) is not None),
        itl_s=percentiles(gap for r in ok for gap in r.itls_s),
        e2e_s=percentiles(e for r in ok if (e := r.e2e_s) is not None),
        ttft_p90_with_failures_s=p90 if math.isfinite(p90) else None,
    )


@dataclass(frozen=True)
class ThroughputSummary:
    window_s: float
    num_measured: int
    num_ok: int
    requests_per_s: float
    output_tokens_per_s: float
    goodput_per_s: float
    slo_attainment: float  # fraction of measured requests that met both SLOs
    mean_prompt_tokens: float | None
    mean_output_tokens: float | None
    errors: dict[str, int]
    error_examples: dict[str, str]  # one message per kind, to act on


def throughput_summary(
    records: Sequence[RequestRecord],
    slo: Slo,
    completed_in_window: tuple[Sequence[RequestRecord], float] | None = None,
) -> ThroughputSummary:
    """Counts and shares over the measured ``records``; rates over a window.

    Open loop, the window runs from the first measured send to the last measured end: the
    schedule fixes what is sent, and each request is followed to its end. A closed loop
    passes ``completed_in_window``: the requests that ended inside its measuring window
    (warm-up's included) and the window's length. There the span would be wrong by far:
    when one request outlasts the window (32 users on a server that serves one at a time,
    28 s each, in a 12 s window) the window's sends are divided by their whole tail, a
    third of the rate the server kept up.
    """
    ok = [r for r in records if r.is_ok]
    if completed_in_window is not None and completed_in_window[1] > 0:
        rated, window_s = completed_in_window
    else:
        rated = records
        window_s = (
            max(r.end_s for r in records) - min(r.sent_s for r in records) if records else 0.0
        )
    per_s = 1.0 / window_s if window_s > 0 else 0.0
    rated_ok = [r for r in rated if r.is_ok]
    num_good = sum(meets_slo(r, slo) for r in records)
    num_good_rated = sum(meets_slo(r, slo) for r in rated)
    prompt_counts = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens is not None]
    errors = Counter(r.error for r in records if r.error is not None)
    examples: dict[str, str] = {}
    for r in records:
        if r.error is not None:
            examples.setdefault(r.error, r.error_detail)
    return ThroughputSummary(
        window_s=window_s,
        num_measured=len(records),
        num_ok=len(ok),
        requests_per_s=len(rated_ok) * per_s,
        output_tokens_per_s=sum(r.num_output_tokens for r in rated_ok) * per_s,
        goodput_per_s=num_good_rated * per_s,
        slo_attainment=num_good / len(records) if records else 0.0,
        mean_prompt_tokens=sum(prompt_counts) / len(prompt_counts) if prompt_counts else None,
        mean_output_tokens=sum(r.num_output_tokens for r in ok) / len(ok) if ok else None,
        errors=dict(sorted(errors.items())),
        error_examples=examples,
    )
