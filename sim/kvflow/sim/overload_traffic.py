"""The overload scenario's traffic: three tenants in three priority classes, open loop.

Two named mixes (``SCENARIOS``; ``parse_mix`` reads any other), the same three class
targets (``CLASS_SLOS``): realtime TTFT 1 s, TPOT 100 ms (a person waits on every token);
normal 3 s, 150 ms; batch 30 s, 300 ms (nobody watches it stream).

- ``batch-heavy`` (the default, ``DEFAULT_MIX``): ``chat`` (realtime, 15 %, 256 prompt
  tokens / 64 output), ``app`` (normal, 15 %, 512 / 128), ``reports`` (batch, 70 %,
  1,024 / 1,024). The batch tenant carries most of the compute (96 % of the output
  tokens), as an offline job does when it shares a pool with interactive traffic: the
  overload is batch's, which the class scheduler and class-ordered shedding already keep
  away from the interactive classes.
- ``interactive-heavy`` (``INTERACTIVE_MIX``): the same shape with the bulk tenant's role
  swapped. ``assistant`` (normal, 70 %, 512 / 768) is a chat assistant that writes long
  answers (code, drafts), ``chat`` (realtime, 15 %, 256 / 64) stays short, ``reports``
  (batch, 15 %, 1,024 / 1,024) is a backfill job. The normal class alone carries 77 % of
  the output tokens, so at twice the capacity it asks about 1.5x the pool by itself: no
  ordering of classes can serve it, its own requests queue behind each other.

Requests arrive as one Poisson stream whose class is drawn per request by the mix's
shares. Every prompt is fresh text (no prefix reuse), so the cache does not blur what
admission and degradation do. The rate follows a piecewise profile in multiples of the
pool's measured capacity (``LoadPhase``): calm, then the overload, then calm again so the
ladder's releases show.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock, content_namespace
from kvflow.proto.priority_class import PriorityClass


@dataclass(frozen=True)
class ClassSlo:
    """A class's latency targets: a request meets its SLO when both hold."""

    ttft_s: float
    tpot_s: float

    def is_met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        if ttft_s is None or ttft_s > self.ttft_s:
            return False
        return tpot_s is None or tpot_s <= self.tpot_s


@dataclass(frozen=True)
class TenantTraffic:
    tenant: str
    priority_class: PriorityClass
    share: float  # of the requests
    prompt_tokens: int
    output_tokens: int
    slo: ClassSlo


CLASS_SLOS: Mapping[PriorityClass, ClassSlo] = {
    PriorityClass.REALTIME: ClassSlo(1.0, 0.10),
    PriorityClass.NORMAL: ClassSlo(3.0, 0.15),
    PriorityClass.BATCH: ClassSlo(30.0, 0.30),
}
# The tenant a ``--mix`` entry's class gets (one tenant per class).
CLASS_TENANTS: Mapping[PriorityClass, str] = {
    PriorityClass.REALTIME: "chat",
    PriorityClass.NORMAL: "app",
    PriorityClass.BATCH: "reports",
}
_RT, _NORMAL, _BATCH = PriorityClass.REALTIME, PriorityClass.NORMAL, PriorityClass.BATCH

DEFAULT_MIX: tuple[TenantTraffic, ...] = (
    TenantTraffic("chat", _RT, 0.15, 256, 64, CLASS_SLOS[_RT]),
    TenantTraffic("app", _NORMAL, 0.15, 512, 128, CLASS_SLOS[_NORMAL]),
    TenantTraffic("reports", _BATCH, 0.70, 1024, 1024, CLASS_SLOS[_BATCH]),
)
INTERACTIVE_MIX: tuple[TenantTraffic, ...] = (
    TenantTraffic("chat", _RT, 0.15, 256, 64, CLASS_SLOS[_RT]),
    TenantTraffic("assistant", _NORMAL, 0.70, 512, 768, CLASS_SLOS[_NORMAL]),
    TenantTraffic("reports", _BATCH, 0.15, 1024, 1024, CLASS_SLOS[_BATCH]),
)
DEFAULT_SCENARIO = "batch-heavy"
SCENARIOS: Mapping[str, tuple[TenantTraffic, ...]] = {
    DEFAULT_SCENARIO: DEFAULT_MIX,
    "interactive-heavy": INTERACTIVE_MIX,
}


@dataclass(frozen=True)
class LoadPhase:
    duration_s: float
    load: float  # offered rate as a multiple of the pool's capacity


# 60 s calm (half the capacity), 240 s at twice the capacity, 420 s calm: the ladder reverts
# a step per 120 s calm, so its three steps need 360 s to go.
DEFAULT_PHASES: tuple[LoadPhase, ...] = (
    LoadPhase(60.0, 0.5),
    LoadPhase(240.0, 2.0),
    LoadPhase(420.0, 0.5),
)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    request: BenchRequest
    traffic: TenantTraffic


def check_mix(mix: Sequence[TenantTraffic]) -> None:
    if not mix:
        raise ValueError("the traffic mix needs at least one tenant")
    if abs(sum(t.share for t in mix) - 1.0) > 1e-6:
        raise ValueError(f"the mix's shares must sum to 1, got {sum(t.share for t in mix):g}")
    if len({t.tenant for t in mix}) != len(mix):
        raise ValueError("each tenant appears once in the mix")


N = TypeVar("N", int, float)
MIX_FORMAT = "CLASS:SHARE:PROMPT_TOKENS:OUTPUT_TOKENS,..."


def parse_mix(text: str) -> tuple[TenantTraffic, ...]:
    """A mix from ``CLASS:SHARE:PROMPT_TOKENS:OUTPUT_TOKENS,...`` (e.g.
    ``realtime:0.15:256:64,normal:0.7:512:768,batch:0.15:1024:1024``): each class at most
    once, with its ``CLASS_SLOS`` targets and ``CLASS_TENANTS`` tenant; the shares are
    fractions of the requests and sum to 1. ValueError says which entry is wrong and why."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise ValueError(f"the mix is empty: give {MIX_FORMAT}")
    mix: list[TenantTraffic] = []
    for entry in entries:
        fields = entry.split(":")
        if len(fields) != 4:
            raise ValueError(f"mix entry {entry!r} has {len(fields)} fields: give {MIX_FORMAT}")
        try:
            klass = PriorityClass.parse(fields[0])
        except ValueError as exc:
            raise ValueError(f"mix entry {entry!r}: {exc}") from None
        if any(t.priority_class is klass for t in mix):
            raise ValueError(f"mix entry {entry!r}: the class {klass.value} appears twice")
        share = _number(entry, "share", fields[1], float)
        if not 0.0 < share <= 1.0:
            raise ValueError(f"mix entry {entry!r}: the share must be in (0, 1], got {share:g}")
        prompt = _number(entry, "prompt tokens", fields[2], int)
        output = _number(entry, "output tokens", fields[3], int)
        if prompt < 1 or output < 1:
            raise ValueError(f"mix entry {entry!r}: token counts must be >= 1")
        mix.append(TenantTraffic(CLASS_TENANTS[klass], klass, share, prompt, output,
                                 CLASS_SLOS[klass]))  # fmt: skip
    check_mix(mix)
    return tuple(mix)


def _number(entry: str, what: str, text: str, kind: Callable[[str], N]) -> N:
    try:
        return kind(text)
    except ValueError:
        noun = "whole number" if kind is int else "number"
        raise ValueError(f"mix entry {entry!r}: the {what} {text!r} is not a {noun}") from None


def mix_request(
    mix: Sequence[TenantTraffic], index: int, rng: random.Random, *, seed: int, namespace: str
) -> tuple[BenchRequest, TenantTraffic]:
    """The ``index``-th request: its tenant drawn by share, its prompt fresh text."""
    traffic = rng.choices(mix, weights=[t.share for t in mix])[0]
    request_id = f"{namespace}-{traffic.tenant}-{index}"
    request = BenchRequest(
        request_id=request_id,
        namespace=content_namespace(seed, namespace),
        session_id=request_id,
        segments=(Segment("user", (TextBlock(f"prompt-{index}", traffic.prompt_tokens),)),),
        num_output_tokens=traffic.output_tokens,
    )
    return request, traffic


def arrivals(
    mix: Sequence[TenantTraffic],
    phases: Sequence[LoadPhase],
    capacity_per_s: float,
    *,
    seed: int,
    namespace: str = "overload",
) -> list[Arrival]:
    """Poisson arrivals through the phases, ``load x capacity_per_s`` requests per second
    in each; the same list for every arm (the draws depend on the seed alone)."""
    check_mix(mix)
    rng = random.Random(f"{seed}/overload-arrivals")
    out: list[Arrival] = []
    start_s = 0.0
    for phase in phases:
        rate = phase.load * capacity_per_s
        at_s = start_s
        end_s = start_s + phase.duration_s
        while rate > 0:
            at_s += rng.expovariate(rate)
            if at_s >= end_s:
                break
            request, traffic = mix_request(mix, len(out), rng, seed=seed, namespace=namespace)
            out.append(Arrival(at_s, request, traffic))
        start_s = end_s
    return out


def load_at(phases: Sequence[LoadPhase], at_s: float) -> float:
    start_s = 0.0
    for phase in phases:
        if at_s < start_s + phase.duration_s:
            return phase.load
        start_s += phase.duration_s
    return 0.0
