"""Prometheus text exposition -> one target's counters, gauges and histograms (pure).

Only the families the planner reads are kept, each summed over its labels (a worker's
`requests_finished{finish_reason}` becomes one count). Counters and histograms are
cumulative since the target started; `window` turns two reads into what happened between.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts by upper bound (ascending, the last one +Inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    count: float
    sum: float

    def __add__(self, other: Histogram) -> Histogram:
        assert self.bounds == other.bounds, "adding histograms with different buckets"
        return Histogram(
            self.bounds,
            tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
            self.count + other.count,
            self.sum + other.sum,
        )

    def __sub__(self, other: Histogram) -> Histogram:
        return self + Histogram(
            other.bounds, tuple(-c for c in other.cumulative), -other.count, -other.sum
        )


@dataclass(frozen=True)
class Metrics:
    """One target's families, by family name (counters without their `_total`)."""

    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)


class ExpositionError(ValueError):
    """The text is not Prometheus' exposition format."""


def parse(
    text: str,
    families: Collection[str],
    match: Mapping[str, Mapping[str, str]] | None = None,
    drop: Mapping[str, str] | None = None,
) -> Metrics:
    """The named families of an exposition; absent families are simply missing.

    ``match``: per family, label values a sample must carry to count (a gateway's router
    reports every pool it fronts; one pool's planner reads only its own series). A family
    it does not name keeps every sample.

    ``drop``: label values that leave a sample of any family out (the planner drops the
    workers' batch-class series: `observation.OFFLINE_SERIES`). A sample without the label
    counts (a worker that predates it)."""
    match, drop = match or {}, drop or {}
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    totals: dict[str, list[float]] = {}
    try:
        parsed = list(text_string_to_metric_families(text))
    except (ValueError, IndexError) as exc:  # the parser's errors for malformed lines
        raise ExpositionError(f"not Prometheus text: {exc}") from exc
    try:
        _fold(parsed, families, match, drop, counters, gauges, buckets, totals)
    except (KeyError, ValueError, TypeError) as exc:
        # A bucket without `le`, or with one that is not a number (a foreign exporter, a
        # proxy): a failed read like any other, never an error that stops the planner.
        raise ExpositionError(f"a malformed sample: {exc!r}") from exc
    if families and not (counters or gauges or buckets):
        # A 200 with none of the families (an empty body, another server's page) is no read:
        # taken as one, its target's next window would span its whole life.
        raise ExpositionError("none of the planner's metric families")
    histograms = {
        name: Histogram(
            tuple(sorted(by_le)),
            tuple(by_le[le] for le in sorted(by_le)),
            totals[name][0],
            totals[name][1],
        )
        for name, by_le in buckets.items()
    }
    return Metrics(counters, gauges, histograms)


def _fold(
    parsed: list[Any],
    families: Collection[str],
    match: Mapping[str, Mapping[str, str]],
    drop: Mapping[str, str],
    counters: dict[str, float],
    gauges: dict[str, float],
    buckets: dict[str, dict[float, float]],
    totals: dict[str, list[float]],
) -> None:
    """The wanted samples of ``parsed`` summed into the four maps (``parse``)."""
    for family in parsed:
        if family.name not in families:
            continue
        if family.type == "counter":
            # A labelled counter has no sample before its first label set (a worker that
            # finished nothing yet): it counted zero, it is not missing.
            counters.setdefault(family.name, 0.0)
        wanted = match.get(family.name, {})
        for sample in family.samples:
            if any(sample.labels.get(k) != v for k, v in wanted.items()):
                continue
            if any(sample.labels.get(k) == v for k, v in drop.items()):
                continue
            if math.isnan(sample.value):
                continue  # not measured (a NaN KV usage read as calm): as if absent
            if family.type == "counter" and sample.name.endswith("_total"):
                counters[family.name] = counters.get(family.name, 0.0) + sample.value
            elif family.type == "gauge":
                gauges[family.name] = gauges.get(family.name, 0.0) + sample.value
            elif family.type == "histogram":
                by_le = buckets.setdefault(family.name, {})
                count_sum = totals.setdefault(family.name, [0.0, 0.0])
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                    by_le[le] = by_le.get(le, 0.0) + sample.value
                elif sample.name.endswith("_count"):
                    count_sum[0] += sample.value
                elif sample.name.endswith("_sum"):
                    count_sum[1] += sample.value


def window(now: Metrics, before: Metrics | None) -> Metrics:
    """What a target counted between two reads; gauges are the latest read.

    A counter that went down means the target restarted: its whole count is new (it is at
    most one interval old), as Prometheus' `increase` assumes.
    """
    if before is None:
        return now
    restarted = any(v < before.counters.get(k, 0.0) for k, v in now.counters.items()) or any(
        h.count < before.histograms[k].count
        for k, h in now.histograms.items()
        if k in before.histograms
    )
    if restarted:
        return now
    return Metrics(
        counters={k: v - before.counters.get(k, 0.0) for k, v in now.counters.items()},
        gauges=dict(now.gauges),
        histograms={
            k: h - before.histograms[k]
            if k in before.histograms and before.histograms[k].bounds == h.bounds
            else h
            for k, h in now.histograms.items()
        },
    )
