"""The routing comparison over several seeds: each seed's arms share its arrivals (and its
generated traces), and every number is summarised across seeds. Pure.

A ``--quick`` rung measures a few hundred requests, so one seed's ratio near a target
moves by 0.1-0.2 from seed to seed: a verdict needs several. Per workload, rung, arm and
metric the report gives the mean, the standard deviation and the range over seeds; per
target, each seed's own value (the ratio the target is about, judged as on one seed:
the worst judged rung of that seed) summarised as mean, min and max, and the target
judged on the mean. The worst rung is taken per seed before the mean, so the judgement
is conservative: where the seeds judge the same rungs, a "<=" target's mean is at least
every rung's own mean over seeds (a ">=" target's at most), and a target met on it is met
at every rung on average.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvflow.loadgen.summary import LoadPointSummary
from kvflow.sim.compare import ComparisonResult, verdicts
from kvflow.sim.targets import Verdict


@dataclass(frozen=True)
class Spread:
    """One number over seeds. ``per_seed`` keeps NaN (nothing measured, no rung to
    judge); the summary skips it, and is NaN when every seed is. An infinite value (more
    than 10 % failed) makes the mean infinite."""

    per_seed: tuple[float, ...]
    mean: float
    sd: float
    min: float
    max: float

    @property
    def num_values(self) -> int:
        return sum(1 for v in self.per_seed if not math.isnan(v))


def spread(values: Sequence[float]) -> Spread:
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return Spread(tuple(values), math.nan, math.nan, math.nan, math.nan)
    if any(math.isinf(v) for v in known):
        mean, sd = math.fsum(known) / len(known), math.nan
    else:
        mean = statistics.fmean(known)
        sd = statistics.stdev(known) if len(known) > 1 else 0.0
    return Spread(tuple(values), mean, sd, min(known), max(known))


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _ttft_p90(point: LoadPointSummary) -> float:
    p90 = point.latency.ttft_p90_with_failures_s
    return math.inf if p90 is None else p90


# The per-rung numbers the single-seed table shows, by their JSON names.
METRICS: dict[str, Callable[[LoadPointSummary], float]] = {
    "ttft_p90_s": _ttft_p90,
    "ttft_p50_s": lambda p: _or_nan(p.latency.ttft_s.p50),
    "tpot_p50_s": lambda p: _or_nan(p.latency.tpot_s.p50),
    "hit_rate": lambda p: _or_nan(p.cache.hit_rate),
    "load_imbalance": lambda p: _or_nan(p.cache.load_imbalance),
}


@dataclass(frozen=True)
class RungSpread:
    workload: str
    arm: str
    label: str
    qps: float
    seeds: tuple[int, ...]  # the seeds that ran this ladder
    metrics: dict[str, Spread]


def rung_spreads(runs: Sequence[tuple[int, ComparisonResult]]) -> list[RungSpread]:
    """Every (workload, arm, rung) over the seeds that ran its ladder, in first-seen order.
    Rungs are matched by position and must carry the same label in every seed."""
    ladders: dict[tuple[str, str], list[tuple[int, list[LoadPointSummary]]]] = {}
    for seed, result in runs:
        for item in result.ladders:
            ladders.setdefault((item.workload, item.arm), []).append((seed, item.points))
    out = []
    for (workload, arm), per_seed in ladders.items():
        first = per_seed[0][1]
        for seed, points in per_seed:
            labels = [p.label for p in points]
            if labels != [p.label for p in first]:
                raise ValueError(f"{workload} / {arm}: seed {seed} ran other rungs "
                                 f"({labels}) than seed {per_seed[0][0]}")  # fmt: skip
        for i, point in enumerate(first):
            metrics = {name: spread([get(points[i]) for _, points in per_seed])
                       for name, get in METRICS.items()}  # fmt: skip
            seeds = tuple(seed for seed, _ in per_seed)
            out.append(RungSpread(workload, arm, point.label, point.qps, seeds, metrics))
    return out


_TARGET = re.compile(r"^(<=|>=) ([0-9.]+)x?$")


def meets(value: float, target: str) -> bool:
    """Whether ``value`` meets a verdict's stated target (``"<= 1.05x"``, ``">= 0.9"``).
    NaN (nothing judged) meets nothing."""
    match = _TARGET.match(target)
    if match is None:
        raise ValueError(f"not a target: {target!r}")
    limit = float(match.group(2))
    return value <= limit if match.group(1) == "<=" else value >= limit


def target_key(name: str) -> str:
    """A verdict's name without a trailing parenthesis (the rung a seed's baseline
    saturated at may differ between seeds; it is the same target)."""
    return re.sub(r" \([^)]*\)$", "", name)


@dataclass(frozen=True)
class SeedVerdict:
    name: str
    target: str
    is_target: bool
    value: Spread
    is_met_on_mean: bool
    met_seeds: int  # how many seeds' own verdicts were met
    seeds: tuple[int, ...]  # the seeds that judged this target
    details: tuple[str, ...]  # each seed's detail, in ``seeds`` order


def seed_verdicts(per_seed: Sequence[tuple[int, Sequence[Verdict]]]) -> list[SeedVerdict]:
    """Each target over the seeds that judged it, in first-seen order: its per-seed
    values summarised, and judged on their mean."""
    groups: dict[str, list[tuple[int, Verdict]]] = {}
    for seed, items in per_seed:
        for verdict in items:
            groups.setdefault(target_key(verdict.name), []).append((seed, verdict))
    out = []
    for key, group in groups.items():
        first = group[0][1]
        value = spread([v.value for _, v in group])
        is_met = first.is_target and not math.isnan(value.mean) and meets(value.mean, first.target)
        out.append(SeedVerdict(
            key, first.target, first.is_target, value, is_met,
            sum(1 for _, v in group if v.is_target and v.is_met),
            tuple(seed for seed, _ in group), tuple(v.detail for _, v in group),
        ))  # fmt: skip
    return out


def results_verdicts(runs: Sequence[tuple[int, ComparisonResult]]) -> list[SeedVerdict]:
    return seed_verdicts([(seed, verdicts(result)) for seed, result in runs])
