"""The overload scenario's traffic: three tenants in three priority classes, open loop.

- ``chat`` (REALTIME): short chat turns, 256 prompt tokens, 64 output tokens; a person
  waits on every token (TTFT 1 s, TPOT 100 ms).
- ``app`` (NORMAL): an application's calls, 512 prompt tokens, 128 output tokens (TTFT
  3 s, TPOT 150 ms).
- ``reports`` (BATCH): offline generation with long outputs, 1,024 prompt tokens, 1,024
  output tokens (TTFT 30 s, TPOT 300 ms: nobody watches it stream).

Requests arrive as one Poisson stream whose class is drawn per request by the mix's shares
(15 % chat, 15 % app, 70 % reports by default): the batch tenant carries most of the
compute (its outputs are 96 % of the output tokens), as an offline job does when it
shares a pool with interactive traffic. Every prompt is fresh text (no prefix reuse), so
the cache does not blur what admission and degradation do. The rate follows a piecewise
profile in multiples of the pool's measured capacity (``LoadPhase``): calm, then the
overload, then calm again so the ladder's releases show.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

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


DEFAULT_MIX: tuple[TenantTraffic, ...] = (
    TenantTraffic("chat", PriorityClass.REALTIME, 0.15, 256, 64, ClassSlo(1.0, 0.10)),
    TenantTraffic("app", PriorityClass.NORMAL, 0.15, 512, 128, ClassSlo(3.0, 0.15)),
    TenantTraffic("reports", PriorityClass.BATCH, 0.70, 1024, 1024, ClassSlo(30.0, 0.30)),
)


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
