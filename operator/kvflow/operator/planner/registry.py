"""The planner's measured signals, one record each: its name, the side of a role it reads,
the observation fields it needs, the reasons it scales up with, and when it is calm.

`signals.assess` runs every signal of a role's sides in this order. A signal never decides
alone: over its threshold it asks (`SignalContext.ask`, which knows whether the profile
says the pool already has room, or appends a `Want` itself); present but near its limit it
holds a scale-down (`Reading.not_calm`); absent while traffic flows it is named in
`Reading.missing` and holds a scale-down too. To add a signal, write its `read` and append
it to `SIGNALS`; the docs' table (docs/planner.md) and the registry test follow the record.
Pure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvflow.operator.planner.types import DecisionReason, Observation, PlannerConfig

Side = Literal["prefill", "decode"]
Ask = Callable[[float, DecisionReason, str], None]


@dataclass
class Reading:
    """What the signals said so far in one assessment, in the order they said it."""

    wants: list[Want] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # inputs absent while traffic flows
    not_calm: list[str] = field(default_factory=list)  # what holds a scale-down
    is_blind: bool = False  # a latency the role is judged on is unmeasured


@dataclass(frozen=True)
class SignalContext:
    obs: Observation
    config: PlannerConfig
    is_idle: bool  # no request came this window
    ask: Ask  # a scale-up asked by a factor of the ready replicas' work


@dataclass(frozen=True)
class Signal:
    name: str
    side: Side
    inputs: tuple[str, ...]  # Observation fields it reads
    asks: tuple[DecisionReason, ...]  # what it scales up with
    calm_when: str  # when it lets the role shrink, for the docs
    read: Callable[[SignalContext, Reading], None]


@dataclass(frozen=True)
class Want:
    replicas: int
    reason: DecisionReason
    detail: str
    is_reactive: bool  # measured latency/queue/KV (a cooldown applies) vs capacity sizing
    # Replicas the stabilization window remembers for this ask (None: `replicas`). A
    # backlog's extra replicas are for a drain, not for a load that may come back.
    sustained: int | None = None


def scaled(ready: int, factor: float, cap: float) -> int:
    """Replicas for `factor` times the work of `ready`: always at least one more."""
    return max(ready + 1, math.ceil(ready * min(factor, cap)))


def _latency(
    ctx: SignalContext,
    r: Reading,
    name: str,
    value: float | None,
    frac: float | None,
    target: float,
) -> None:
    """A latency at the percentile, and the share of requests over its target."""
    config, t = ctx.config, ctx.config.tuning
    budget = 1 - config.percentile / 100  # the share of requests allowed over target
    reason: DecisionReason = "TtftViolation" if name == "TTFT" else "TpotViolation"
    ratio = None if value is None else value / target
    over_frac = frac is not None and frac > budget
    if (ratio is not None and ratio > 1) or over_frac:
        factor = ratio if ratio is not None and ratio > 1 else (frac or 0) / budget
        shown = f"{value:.3g} s" if value is not None else "unmeasured"
        frac_text = "" if frac is None else f", {frac:.0%} of requests over"
        text = f"{name} p{config.percentile:g} {shown} vs target {target:.3g} s{frac_text}"
        ctx.ask(factor, reason, text)
    if value is None:
        if not ctx.is_idle:
            r.missing.append(f"{name.lower()}_s")
            r.not_calm.append(f"{name} unmeasured")
            r.is_blind = True
    elif ratio is not None and ratio >= t.scale_down_latency_ratio:
        over = f"{t.scale_down_latency_ratio:.0%} of target"
        r.not_calm.append(f"{name} {value:.3g} s is over {over}")


def read_ttft(ctx: SignalContext, r: Reading) -> None:
    obs = ctx.obs
    _latency(ctx, r, "TTFT", obs.ttft_s, obs.ttft_violation_fraction, ctx.config.ttft_target_s)


def read_tpot(ctx: SignalContext, r: Reading) -> None:
    obs = ctx.obs
    _latency(ctx, r, "TPOT", obs.tpot_s, obs.tpot_violation_fraction, ctx.config.tpot_target_s)


def read_queue_wait(ctx: SignalContext, r: Reading) -> None:
    obs, config, t = ctx.obs, ctx.config, ctx.config.tuning
    wait = obs.prefill_queue_wait_s
    wait_limit_s = t.queue_wait_ratio * config.ttft_target_s
    ttft_is_low = obs.ttft_s is not None and (
        obs.ttft_s < t.scale_down_latency_ratio * config.ttft_target_s
    )
    if wait is None:
        if not ctx.is_idle:
            r.missing.append("prefill_queue_wait_s")
            r.not_calm.append("queue wait unmeasured")
    elif wait > wait_limit_s and not ttft_is_low:
        # A mean wait over the limit while TTFT at the percentile is low is the tail of a
        # backlog that has drained (the last queued requests just started): the wait warns
        # of TTFT trouble, and there is none.
        text = f"prompts wait {wait:.3g} s before prefill (limit {wait_limit_s:.3g} s)"
        ctx.ask(wait / wait_limit_s, "QueueWait", text)
    elif wait > wait_limit_s / 2:
        r.not_calm.append(f"queue wait {wait:.3g} s")


def read_kv_usage(ctx: SignalContext, r: Reading) -> None:
    obs, t = ctx.obs, ctx.config.tuning
    kv = obs.kv_usage
    if kv is None:
        if not ctx.is_idle:
            r.missing.append("kv_usage")
            r.not_calm.append("KV usage unmeasured")
    elif kv > t.kv_usage_high:
        # KV pressure is not a latency a profile explains away: it asks on its own.
        replicas = scaled(obs.ready_replicas, kv / t.target_utilization, t.max_scale_up_factor)
        text = f"KV cache {kv:.0%} full (limit {t.kv_usage_high:.0%})"
        r.wants.append(Want(replicas, "KvPressure", text, is_reactive=True))
    elif kv >= t.kv_usage_low:
        r.not_calm.append(f"KV cache {kv:.0%} full")


SIGNALS: tuple[Signal, ...] = (
    Signal(
        name="TTFT",
        side="prefill",
        inputs=("ttft_s", "ttft_violation_fraction"),
        asks=("TtftViolation",),
        calm_when="TTFT at the percentile under scaleDownLatencyRatio of its target",
        read=read_ttft,
    ),
    Signal(
        name="queue wait",
        side="prefill",
        inputs=("prefill_queue_wait_s",),
        asks=("QueueWait",),
        calm_when="the mean wait before prefill under half its limit (queueWaitRatio x TTFT)",
        read=read_queue_wait,
    ),
    Signal(
        name="TPOT",
        side="decode",
        inputs=("tpot_s", "tpot_violation_fraction"),
        asks=("TpotViolation",),
        calm_when="TPOT at the percentile under scaleDownLatencyRatio of its target",
        read=read_tpot,
    ),
    Signal(
        name="KV usage",
        side="decode",
        inputs=("kv_usage",),
        asks=("KvPressure",),
        calm_when="the KV cache under kvUsageLow full",
        read=read_kv_usage,
    ),
)
