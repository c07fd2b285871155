"""The planner's inputs from Prometheus: one PromQL query per interval, and its answer
turned into the same per-target `Metrics` a direct scrape gives (pure).

The query asks for what happened over the window (`increase` of every counter and
histogram series) and the gauges now, for one pool (`namespace` and `pool` labels, which
the chart's PodMonitors copy from the pods). Each series comes back tagged with the series
it was (`kvflow_series`, since `increase` drops the metric name), and the answer is folded
per scraped target (`instance`) into `exposition.Metrics`, so `observation.observe_role`
computes the role's `Observation` exactly as it does from direct scrapes: the two sources
differ only in what they read, not in the arithmetic.

What differs in what they read: Prometheus' `increase` extrapolates each series to the
window's edges from the samples inside it (fractional counts; each series on its own, so a
histogram's buckets may come back slightly out of order, which `_histogram` repairs), and
its window ends at its last scrape, up to one scrape interval before the planner asks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvflow.operator.observe.exposition import Histogram, Metrics
from kvflow.proto.metric_names import (
    CLASS_LABEL,
    ROUTER_SHED,
    ROUTER_TPOT,
    ROUTER_TTFT,
    WORKER_FINISHED,
    WORKER_GENERATION_TOKENS,
    WORKER_KV_CLASS_USAGE,
    WORKER_KV_USAGE,
    WORKER_PROMPT_TOKENS,
    WORKER_QUEUE_WAIT,
    WORKER_RUNNING,
    WORKER_TPOT,
    WORKER_TTFT,
    WORKER_WAITING,
)
from kvflow.proto.priority_class import PriorityClass

# The label each answer's series carries: the series it was computed from.
SERIES_LABEL = "kvflow_series"
COUNTERS = (WORKER_FINISHED, WORKER_PROMPT_TOKENS, WORKER_GENERATION_TOKENS, ROUTER_SHED)
HISTOGRAMS = (WORKER_TTFT, WORKER_TPOT, WORKER_QUEUE_WAIT, ROUTER_TTFT, ROUTER_TPOT)
GAUGES = (WORKER_RUNNING, WORKER_WAITING, WORKER_KV_USAGE, WORKER_KV_CLASS_USAGE)
ROUTER_PREFIX = "kvflow_router_"


@dataclass(frozen=True)
class PoolSeries:
    """A pool's answer folded per scraped target: workers by role, and the routers."""

    workers: dict[str, dict[str, Metrics]] = field(default_factory=dict)  # role -> target -> m
    routers: dict[str, Metrics] = field(default_factory=dict)  # target -> metrics


class AnswerError(ValueError):
    """Prometheus answered something that is not an instant vector. The message says what
    was wrong, never what was answered: it goes into the pool's status, and the answer is
    whatever the address replied."""


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def pool_query(namespace: str, pool: str, window_s: float) -> str:
    """One instant query for everything the planner reads of pool `namespace/pool`."""
    # The workers' batch-class series are left out, as a direct scrape leaves them out
    # (observation.OFFLINE_SERIES); a series without the label (the routers') still matches.
    offline = _quote(PriorityClass.BATCH.value)
    selector = f"namespace={_quote(namespace)},pool={_quote(pool)},{CLASS_LABEL}!={offline}"
    window = f"[{max(1, round(window_s))}s]"
    windowed = [f"{name}_total" for name in COUNTERS] + [
        f"{name}_{part}" for name in HISTOGRAMS for part in ("bucket", "sum", "count")
    ]
    terms = [
        f'label_replace(increase({series}{{{selector}}}{window}), "{SERIES_LABEL}", '
        f'"{series}", "", "")'
        for series in windowed
    ]
    gauges = "|".join(GAUGES)
    terms.append(
        f'label_replace({{__name__=~"{gauges}",{selector}}}, "{SERIES_LABEL}", "$1", '
        '"__name__", "(.+)")'
    )
    return " or ".join(terms)


def _value(sample: object) -> float:
    if not isinstance(sample, Mapping):
        raise AnswerError(f"not a sample (a {type(sample).__name__})")
    value = sample.get("value")
    if not isinstance(value, Sequence) or len(value) != 2:
        raise AnswerError("a sample without [time, value]")
    try:
        return float(value[1])
    except (TypeError, ValueError) as exc:
        raise AnswerError("a sample value that is not a number") from exc


def fold(data: object) -> PoolSeries:
    """The `data` of a successful /api/v1/query answer to `pool_query`, per target."""
    if not isinstance(data, Mapping) or data.get("resultType") != "vector":
        raise AnswerError("the answer is not an instant vector")
    result = data.get("result")
    if not isinstance(result, list):
        raise AnswerError("the answer has no result list")
    # (component role, target) -> kind -> name -> values
    counters: dict[tuple[str, str], dict[str, float]] = {}
    gauges: dict[tuple[str, str], dict[str, float]] = {}
    parts: dict[tuple[str, str], dict[str, dict[str, float]]] = {}  # name -> le/sum/count
    for sample in result:
        value = _value(sample)
        assert isinstance(sample, Mapping)  # _value checked
        labels = sample.get("metric") or {}
        if not isinstance(labels, Mapping):
            raise AnswerError("sample labels that are not an object")
        series = str(labels.get(SERIES_LABEL, ""))
        target = str(labels.get("instance") or labels.get("pod") or "")
        is_router = series.startswith(ROUTER_PREFIX)
        key = ("router" if is_router else str(labels.get("role", "")), target)
        if math.isnan(value):  # a series with one sample in the window: no increase yet
            continue
        if series.endswith("_total") and series[: -len("_total")] in COUNTERS:
            name = series[: -len("_total")]
            by_name = counters.setdefault(key, {})
            by_name[name] = by_name.get(name, 0.0) + value
        elif series in GAUGES:
            by_name = gauges.setdefault(key, {})
            by_name[series] = by_name.get(series, 0.0) + value
        else:
            name, _, part = series.rpartition("_")
            if name not in HISTOGRAMS or part not in ("bucket", "sum", "count"):
                continue  # not asked for: ignore rather than guess
            slot = "sum" if part == "sum" else "count" if part == "count" else None
            if slot is None:
                slot = repr(float(labels.get("le", "nan")))
            by_part = parts.setdefault(key, {}).setdefault(name, {})
            by_part[slot] = by_part.get(slot, 0.0) + value
    out = PoolSeries()
    for key in sorted({*counters, *gauges, *parts}):
        role, target = key
        metrics = Metrics(
            counters=counters.get(key, {}),
            gauges=gauges.get(key, {}),
            histograms={
                name: h
                for name, slots in parts.get(key, {}).items()
                if (h := _histogram(slots)) is not None
            },
        )
        if role == "router":
            out.routers[target] = metrics
        else:
            out.workers.setdefault(role, {})[target] = metrics
    return out


def _histogram(slots: Mapping[str, float]) -> Histogram | None:
    """One histogram from its windowed parts; None without buckets.

    `increase` extrapolates each bucket on its own (to zero at most), so counts can come
    back a little out of order: cumulative counts are made non-decreasing and no larger
    than the +Inf bucket, which is the count (the same samples as `_count`).
    """
    les = sorted(float(k) for k in slots if k not in ("sum", "count"))
    if not les or not math.isinf(les[-1]):
        return None
    raw = [max(0.0, slots[repr(le)]) for le in les]
    count = raw[-1]
    cumulative: list[float] = []
    running = 0.0
    for c in raw:
        running = min(max(running, c), count)
        cumulative.append(running)
    return Histogram(tuple(les), tuple(cumulative), count, max(0.0, slots.get("sum", 0.0)))
