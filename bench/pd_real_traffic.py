"""The traffic of `bench/pd_real.py` and its per-class numbers. Pure: no clock, no I/O.

Two classes share one open-loop schedule:
- **streams**: short prompts, long outputs, Poisson arrivals: the running decodes that a
  long prompt's prefill stalls when both share a worker;
- **long**: long prompts with short outputs at a steady interval (a fixed period, the
  first one half a period in): the prefills that disaggregation moves elsewhere.

Every arm of one repetition gets the same schedule (arrival times and lengths, from the
seed and the repetition) and its own text (``content``), so no arm hits a cache another
arm filled on the same workers. A word of the harness's list is one token (see
``kvflow.loadgen.text``), so the lengths below are prompt tokens, exactly.

Measured: requests scheduled in ``[warmup_s, horizon_s)``. Arrivals go on for
``cooldown_s`` more so the last measured streams still decode beside new arrivals; the
run stops when the last measured request ends.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvflow.loadgen.arrivals import poisson_offsets_s
from kvflow.loadgen.metrics import LatencySummary, latency_summary
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import ScheduleLimits, ScheduleSummary, schedule_summary
from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock, content_namespace


class Kind(StrEnum):
    STREAM = "stream"
    LONG = "long"


@dataclass(frozen=True)
class Traffic:
    stream_rate_per_s: float
    stream_prompt_tokens: tuple[int, int]  # drawn uniformly, both ends included
    stream_output_tokens: int
    long_interval_s: float
    long_prompt_tokens: tuple[int, int]
    long_output_tokens: int
    warmup_s: float
    measure_s: float
    cooldown_s: float

    @property
    def horizon_s(self) -> float:
        """The end of the measured arrivals."""
        return self.warmup_s + self.measure_s


@dataclass(frozen=True)
class Arrival:
    offset_s: float
    kind: Kind
    num_prompt_tokens: int
    num_output_tokens: int


def schedule(traffic: Traffic, seed: int, repetition: int) -> list[Arrival]:
    """Both classes' arrivals in time order; the same for every arm of a repetition."""
    rng = random.Random(f"pd-real/{seed}/{repetition}")
    end_s = traffic.horizon_s + traffic.cooldown_s
    arrivals = [
        Arrival(t, Kind.STREAM, rng.randint(*traffic.stream_prompt_tokens),
                traffic.stream_output_tokens)
        for t in poisson_offsets_s(traffic.stream_rate_per_s, end_s, rng)
    ]  # fmt: skip
    t_s = traffic.long_interval_s / 2
    while t_s < end_s:
        arrivals.append(Arrival(t_s, Kind.LONG, rng.randint(*traffic.long_prompt_tokens),
                                traffic.long_output_tokens))  # fmt: skip
        t_s += traffic.long_interval_s
    return sorted(arrivals, key=lambda a: a.offset_s)


def requests_for(arrivals: Sequence[Arrival], content: str) -> list[BenchRequest]:
    """One request per arrival, its text keyed by ``content`` (one per arm and repetition).
    The request id carries the class: ``stream-3``, ``long-0``."""
    out: list[BenchRequest] = []
    counts = dict.fromkeys(Kind, 0)
    for a in arrivals:
        request_id = f"{a.kind.value}-{counts[a.kind]}"
        counts[a.kind] += 1
        out.append(
            BenchRequest(
                request_id=request_id,
                namespace=content_namespace(0, content),
                session_id=request_id,
                segments=(Segment("user", (TextBlock(request_id, a.num_prompt_tokens),)),),
                num_output_tokens=a.num_output_tokens,
            )
        )
    return out


def kind_of(request_id: str) -> Kind:
    return Kind(request_id.split("-", 1)[0])


def is_measured(record: RequestRecord, traffic: Traffic) -> bool:
    assert record.scheduled_s is not None, "open loop only"
    return traffic.warmup_s <= record.scheduled_s < traffic.horizon_s


@dataclass(frozen=True)
class RunSummary:
    """One arm's run: each class's latencies, the output rate, whether the schedule held."""

    streams: LatencySummary
    long: LatencySummary
    num_measured: Mapping[Kind, int]
    errors: Mapping[str, int]
    error_examples: Mapping[str, str]
    # Output tokens of the measured requests over the measured window (first measured send
    # to last measured end). Open loop: near the offered rate unless an arm falls behind.
    output_tokens_per_s: float
    mean_prompt_tokens: Mapping[Kind, float | None]
    schedule: ScheduleSummary

    @property
    def is_valid(self) -> bool:
        return self.schedule.is_valid


def summarize_run(
    records: Sequence[RequestRecord], traffic: Traffic, limits: ScheduleLimits
) -> RunSummary:
    measured = [r for r in records if is_measured(r, traffic)]
    by_kind = {k: [r for r in measured if kind_of(r.request_id) is k] for k in Kind}
    ok = [r for r in measured if r.is_ok]
    window_s = (max(r.end_s for r in measured) - min(r.sent_s for r in measured)) if measured else 0
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in measured:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
            examples.setdefault(r.error, r.error_detail)

    def mean_prompt(kind: Kind) -> float | None:
        counts = [r.num_prompt_tokens for r in by_kind[kind] if r.num_prompt_tokens is not None]
        return sum(counts) / len(counts) if counts else None

    return RunSummary(
        streams=latency_summary(by_kind[Kind.STREAM]),
        long=latency_summary(by_kind[Kind.LONG]),
        num_measured={k: len(v) for k, v in by_kind.items()},
        errors=errors,
        error_examples=examples,
        output_tokens_per_s=(sum(r.num_output_tokens for r in ok) / window_s if window_s else 0.0),
        mean_prompt_tokens={k: mean_prompt(k) for k in Kind},
        schedule=schedule_summary(measured, None, limits),
    )
