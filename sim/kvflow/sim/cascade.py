"""A model cascade in virtual time (docs/benchmarks.md, "Model cascade"): a mixed workload
answered by a small pool first, escalated to a large pool when the small answer fails its
check, against sending everything to the large pool.

The gateway's rule (router/kvflow/router/api/cascade.py): the small model generates its
whole answer before anything is sent; a kept answer is then replayed at once (the client's
first token is the small answer's end), an escalated request starts on the large model
when the small answer ends. The small pool never waits on the large one, so the run is
exact in two passes: the small pool serves every request at its arrival, then the large
pool serves the escalated ones at their small answers' ends. Which small answers fail is
the workload's model: a failure rate per kind of prompt (easy, hard), drawn per request
from the seed. Both pools are real engines stepped on the event clock (sim/cluster.py).

Cost: every request's tokens at the small model's prices, plus the escalated ones' at the
large model's, against every request's at the large model's (tenants/money.py's exact
pico-dollar arithmetic).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.engine_worker.sim.profiles import SimProfile, named_profile
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock
from kvflow.router.tenants.money import PICO_USD_PER_USD, ModelPrices, spend_pusd
from kvflow.sim.arms import ARMS
from kvflow.sim.cluster import ClusterSpec, VirtualCluster

_PUSD_PER_USD_PER_MILLION = PICO_USD_PER_USD // 1_000_000


def prices(input_usd: float, output_usd: float) -> ModelPrices:
    """USD per million tokens, as the router's `prices:` take them (cached input: half)."""
    return ModelPrices(round(input_usd * _PUSD_PER_USD_PER_MILLION),
                       round(input_usd * _PUSD_PER_USD_PER_MILLION / 2),
                       round(output_usd * _PUSD_PER_USD_PER_MILLION))  # fmt: skip


@dataclass(frozen=True)
class PromptKind:
    name: str
    share: float  # of the requests
    prompt_words: int
    output_tokens: int
    small_failure_rate: float  # the share of small answers that fail the cascade's check


@dataclass(frozen=True)
class PoolSpec:
    model: str
    profile: str  # a roofline profile (engine_worker/sim/profiles.py)
    num_workers: int
    prices: ModelPrices


@dataclass(frozen=True)
class CascadeScenario:
    kinds: tuple[PromptKind, ...] = (
        PromptKind("easy", 0.7, 300, 80, 0.1),
        PromptKind("hard", 0.3, 1200, 300, 0.6),
    )
    small: PoolSpec = PoolSpec("llama3-8b", "h100-llama3-8b", 2, prices(0.10, 0.40))
    large: PoolSpec = PoolSpec("llama3-70b", "h100x4-llama3-70b", 2, prices(1.00, 4.00))
    num_requests: int = 600
    rate_rps: float = 4.0
    seed: int = 0


@dataclass(frozen=True)
class Planned:
    request: BenchRequest
    kind: str
    arrival_s: float
    escalates: bool


def plan(s: CascadeScenario) -> list[Planned]:
    """The workload: Poisson arrivals, a kind per request by share, and whether its small
    answer fails (all drawn from the seed, so a run is a pure function of the scenario)."""
    rng = random.Random(f"{s.seed}/cascade")
    weights = [k.share for k in s.kinds]
    out, now_s = [], 0.0
    for i in range(s.num_requests):
        now_s += rng.expovariate(s.rate_rps)
        kind = rng.choices(s.kinds, weights)[0]
        escalates = rng.random() < kind.small_failure_rate
        request = BenchRequest(
            request_id=f"r{i}",
            namespace=f"cascade-{s.seed}",
            session_id=f"s{i}",
            # Its own text: no prefix shared between requests (caching is not measured here).
            segments=(Segment("user", (TextBlock(f"r{i}", kind.prompt_words),)),),
            num_output_tokens=kind.output_tokens,
        )
        out.append(Planned(request, kind.name, now_s, escalates))
    return out


def _profile(name: str) -> SimProfile:
    profile = named_profile(name)
    if profile is None:
        raise ValueError(f"unknown profile {name!r}")
    return profile


def serve(pool: PoolSpec, arrivals: Sequence[tuple[BenchRequest, float]], seed: int
          ) -> dict[str, RequestRecord]:  # fmt: skip
    spec = ClusterSpec(_profile(pool.profile), num_workers=pool.num_workers, model=pool.model)
    cluster = VirtualCluster(spec, ARMS["kvflow"], seed=seed)
    for request, at_s in arrivals:
        cluster.submit(request, at_s)
    return {r.request_id: r for r in cluster.run()}


def _cost(p: ModelPrices, r: RequestRecord) -> int:
    return spend_pusd(p, prompt_tokens=r.num_prompt_tokens or 0,
                      cached_tokens=r.num_cached_tokens or 0,
                      completion_tokens=r.num_output_tokens)  # fmt: skip


@dataclass
class Outcome:
    """A request's client-side view: when its first token and its end reached the client."""

    request_id: str
    kind: str
    outcome: str  # answered_small, escalated, or all_large (the baseline)
    ttft_s: float
    e2e_s: float


@dataclass
class CascadeResult:
    scenario: CascadeScenario
    outcomes: list[Outcome] = field(default_factory=list)
    baseline: list[Outcome] = field(default_factory=list)
    cascade_pusd: int = 0
    all_large_pusd: int = 0
    failed: int = 0


def run(s: CascadeScenario) -> CascadeResult:
    planned = plan(s)
    small = serve(s.small, [(p.request, p.arrival_s) for p in planned], s.seed)
    escalated = [p for p in planned if p.escalates]
    large = serve(s.large, [(p.request, small[p.request.request_id].end_s) for p in escalated],
                  s.seed)  # fmt: skip
    baseline = serve(s.large, [(p.request, p.arrival_s) for p in planned], s.seed)
    result = CascadeResult(s)
    for p in planned:
        rid = p.request.request_id
        first, base = small[rid], baseline[rid]
        if not first.is_ok or not base.is_ok or (p.escalates and not large[rid].is_ok):
            result.failed += 1
            continue
        result.cascade_pusd += _cost(s.small.prices, first)
        result.all_large_pusd += _cost(s.large.prices, base)
        assert base.ttft_s is not None
        result.baseline.append(
            Outcome(rid, p.kind, "all_large", base.ttft_s, base.end_s - p.arrival_s)
        )
        if p.escalates:
            second = large[rid]
            result.cascade_pusd += _cost(s.large.prices, second)
            result.outcomes.append(Outcome(rid, p.kind, "escalated",
                                           second.token_times_s[0] - p.arrival_s,
                                           second.end_s - p.arrival_s))  # fmt: skip
        else:
            # Generated whole, then replayed: the first token reaches the client at the end.
            done_s = first.end_s - p.arrival_s
            result.outcomes.append(Outcome(rid, p.kind, "answered_small", done_s, done_s))
    return result


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _latency(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    ttft = [o.ttft_s for o in outcomes]
    e2e = [o.e2e_s for o in outcomes]
    return {"requests": len(outcomes),
            **{f"ttft_p{q}_s": _percentile(ttft, q) for q in (50, 90)},
            **{f"e2e_p{q}_s": _percentile(e2e, q) for q in (50, 90)}}  # fmt: skip


def _pool(p: PoolSpec) -> dict[str, Any]:
    return {"model": p.model, "profile": p.profile, "workers": p.num_workers,
            "prices_pusd_per_token": vars(p.prices)}  # fmt: skip


def summary(r: CascadeResult) -> dict[str, Any]:
    """The published numbers, as plain data (docs/bench-data/)."""
    s = r.scenario
    n = len(r.outcomes)
    escalated = [o for o in r.outcomes if o.outcome == "escalated"]
    by_kind = {
        k.name: {
            "requests": sum(o.kind == k.name for o in r.outcomes),
            "escalated_fraction": (
                sum(o.kind == k.name for o in escalated)
                / max(1, sum(o.kind == k.name for o in r.outcomes))
            ),
            "modelled_small_failure_rate": k.small_failure_rate,
        }
        for k in s.kinds
    }
    saved = 1 - r.cascade_pusd / r.all_large_pusd if r.all_large_pusd else None
    return {
        "scenario": {
            "num_requests": s.num_requests, "rate_rps": s.rate_rps, "seed": s.seed,
            "kinds": [vars(k) for k in s.kinds],
            "small": _pool(s.small),
            "large": _pool(s.large),
        },
        "requests": n,
        "failed": r.failed,
        "escalated_fraction": len(escalated) / n if n else None,
        "by_kind": by_kind,
        "latency": {
            "answered_small": _latency([o for o in r.outcomes if o.outcome == "answered_small"]),
            "escalated": _latency(escalated),
            "cascade_all": _latency(r.outcomes),
            "all_large": _latency(r.baseline),
        },
        "cost_usd": {"cascade": r.cascade_pusd / PICO_USD_PER_USD,
                     "all_large": r.all_large_pusd / PICO_USD_PER_USD},
        "cost_saved_fraction": saved,
    }  # fmt: skip
