"""What one role's metrics say: how many replicas each signal wants, and whether it may shrink.

Prefill (and the prefill side of a colocated role) reads TTFT, prefill queue wait and the
prompt-token load; decode (and the decode side of colocated) reads TPOT, KV usage and the
decode concurrency. Each signal that is present and over its threshold asks for a replica
count (`Want`); the model takes the largest. A role may shrink only when every one of its
signals is present and calm (or the role had no traffic): a missing metric blocks a
scale-down and is named, it never reads as zero. Pure; `model.py` applies bounds,
cooldowns and stabilization.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.planner.registry import SIGNALS, Reading, SignalContext, Want, scaled
from kvflow.operator.planner.types import (
    DecisionReason,
    Observation,
    PlannerConfig,
    RoleConfig,
    Tuning,
    WorkerRole,
)
from kvflow.proto.roles import Role


@dataclass(frozen=True)
class Loads:
    """A role's load now and the load to size for (now or forecast), in replica shares.

    A share is load / one replica's SLO capacity: 2.5 shares fill 2.5 replicas. None: no
    capacity profile, or a metric it needs is missing.
    """

    shares_now: float | None
    shares_sizing: float | None
    text: str  # the loads in their own units, for messages
    # The load fell at each of the last five intervals on every side the role serves
    # (forecast.Holt.is_falling): a decline, not noise around the band's edge.
    is_falling: bool = False


@dataclass(frozen=True)
class Assessment:
    wants: tuple[Want, ...]  # signals over threshold, each with the replicas it asks for
    down_to: int | None  # replicas the role could shrink to with its SLO kept; None: not now
    hold_note: str  # why down_to is None, for messages
    missing: tuple[str, ...]  # inputs that were None
    is_blind: bool  # traffic, but the role's own latency is unmeasured
    draining: str = ""  # over target, improving, and the profile says there is room
    sized: int | None = None  # replicas the load needs at target utilisation (with a profile)
    # Replicas a shrink would land on for this load (mid-band), judged whether or not the
    # band lets it shrink now; None: no shrink could be judged (no profile, unmeasured, or
    # a queue, KV or latency note holds the role).
    settles_at: int | None = None


def backlog_want(
    obs: Observation, loads: Loads, config: PlannerConfig, starting_for_s: float
) -> Want | None:
    """Replicas to serve the load and drain, within `backlog_drain_s`, the queue that will
    be there when a replica ordered now serves.

    Queued requests are demand that came and was not served. Sized for the load alone, a
    pool drains them at the load's margin only: after a 5x step with a 60 s start-up in the
    virtual cluster, 1,800 requests queued while the replicas came, then drained for two
    more minutes with every new request behind them. The queue grows until new replicas
    serve: at the load over the ready replicas until the starting ones serve (in
    `starting_for_s`), then over all of them, for `replica_startup_s` in all.
    """
    t = config.tuning
    waiting, rate, shares = obs.num_waiting_requests, obs.request_rate_per_s, loads.shares_now
    if not waiting or not rate or not shares or loads.shares_sizing is None:
        return None
    requests_per_share = rate / shares  # requests/s one replica serves at its SLO capacity
    ready, starting = obs.ready_replicas, obs.pending_replicas - obs.unschedulable_replicas
    # A queue one replica's worth of prompts drains within half the TTFT target is a batch
    # forming, not a backlog.
    if waiting <= max(ready, 1) * requests_per_share * t.queue_wait_ratio * config.ttft_target_s:
        return None
    startup_s = config.replica_startup_s
    first_s = min(startup_s, starting_for_s) if starting > 0 else startup_s
    short_now, short_then = max(0.0, shares - ready), max(0.0, shares - ready - starting)
    grows = (short_now * first_s + short_then * (startup_s - first_s)) * requests_per_share
    if obs.shed_fraction:
        # The gateway is refusing the excess (admission control): the queue is bounded by
        # its time limit and will not grow while replicas start. Counting the refused as
        # queueing bought 35 replicas after a 5x step at 200 requests/s, 60 s start-up, in
        # the virtual cluster, where 21 carried the load and nothing was left to drain.
        grows = 0.0
    queued = waiting + grows
    extra = queued / t.backlog_drain_s / requests_per_share
    need = t.replicas_for(loads.shares_sizing + extra, t.target_utilization)
    sustained = t.replicas_for(loads.shares_sizing, t.target_utilization)
    text = (
        f"{waiting:.0f} requests queued ({queued:.0f} when a new replica serves): {need} drain "
        f"them within {t.backlog_drain_s:.0f} s"
    )
    return Want(need, "Backlog", text, is_reactive=False, sustained=sustained)


def violation_share(obs: Observation) -> float | None:
    """The larger share of requests over a latency target, or None when neither is known."""
    shares = [
        x for x in (obs.ttft_violation_fraction, obs.tpot_violation_fraction) if x is not None
    ]
    return max(shares) if shares else None


def _sides(role: WorkerRole) -> tuple[bool, bool]:
    return Role(role).prefills, Role(role).decodes


def _pooled(loads: Loads, t: Tuning) -> str:
    shares, pooled = loads.shares_sizing, t.pooled_from_shares
    if shares is None or pooled is None or shares <= pooled:
        return ""
    return f", the margin pooled over {shares:.1f} shares"


def assess(
    role: WorkerRole,
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    loads: Loads,
    saturation_rate_per_replica: float | None = None,
    last_violation_share: float | None = None,
    starting_for_s: float | None = None,
) -> Assessment:
    """`starting_for_s`: how long until the replicas still starting serve (None: unknown,
    a whole start-up)."""
    t = config.tuning
    is_prefill, is_decode = _sides(role)
    ready = obs.ready_replicas
    # Idle: nothing came, and nothing runs or waits. A window in which no request finished
    # while some run (long answers, a stalled engine) is not idleness.
    in_flight = (obs.num_running_requests or 0.0) + (obs.num_waiting_requests or 0.0)
    is_idle = obs.request_rate_per_s == 0 and in_flight == 0
    # With a capacity profile, a latency or queue over its limit while the profile says the
    # replicas asked for carry the load is not a lack of replicas: mostly the tail of a
    # backlog that the replicas already added are draining (its requests queued before they
    # came; TTFT at the percentile stays high for a window after). Doubling then buys
    # replicas that start after the backlog is gone; one more hedges against a profile
    # that overstates.
    sized = None
    if loads.shares_sizing is not None:
        sized = t.replicas_for(loads.shares_sizing, t.target_utilization)
    has_room = sized is not None and obs.desired_replicas > 0 and sized <= obs.desired_replicas

    backlog = None
    if rcfg.capacity is not None:
        wait_for_s = config.replica_startup_s if starting_for_s is None else starting_for_s
        backlog = backlog_want(obs, loads, config, wait_for_s)
    # The queue gauge is now; latency at the percentile is the window's. No backlog now, or
    # one the replicas there are drain within backlog_drain_s, with the replicas the load
    # needs: the latency is the tail of a backlog drained or draining (in the virtual
    # cluster, 324 requests still queued on the replicas that had them bought a replica
    # that could not take them, held for a whole window).
    is_drained = obs.num_waiting_requests is not None and (
        backlog is None or backlog.replicas <= obs.desired_replicas
    )
    share = violation_share(obs)
    is_improving = is_drained or (
        share is not None and last_violation_share is not None and share < last_violation_share
    )
    draining: list[str] = []
    reading = Reading()

    def ask(factor: float, reason: DecisionReason, detail: str) -> None:
        if has_room and is_improving:
            # Fewer requests over target than an interval ago, with the replicas the load
            # needs: a backlog draining. Replicas ordered now would start after it is gone.
            if not is_drained:
                since = f"down from {last_violation_share:.0%} of requests over target"
            elif backlog is None:
                since = "no queue now"
            else:
                since = f"the queue drains within {t.backlog_drain_s:.0f} s"
            draining.append(
                f"{detail}; {since}, and the profile says {obs.desired_replicas} carry the load"
            )
        elif has_room:
            detail = f"{detail}; the profile says {obs.desired_replicas} carry the load: one more"
            reading.wants.append(Want(ready + 1, reason, detail, is_reactive=True))
        else:
            want = Want(scaled(ready, factor, t.max_scale_up_factor), reason, detail, True)
            reading.wants.append(want)

    ctx = SignalContext(obs, config, is_idle, ask)
    sides = {"prefill": is_prefill, "decode": is_decode}
    for signal in SIGNALS:
        if sides[signal.side]:
            signal.read(ctx, reading)
    wants, missing, calm = reading.wants, reading.missing, reading.not_calm
    if obs.request_rate_per_s is None:
        missing.append("request_rate_per_s")
    if backlog is not None:
        calm.append(f"{obs.num_waiting_requests:.0f} requests queued")
    if 2 * obs.num_unread_workers > ready:
        # Most of the role's load is an extrapolation from the few read (observation.py).
        calm.append(f"{obs.num_unread_workers} of {ready} workers unread this interval")
    if obs.request_rate_per_s == 0 and in_flight:
        calm.append(f"{in_flight:.0f} requests in flight, none finished in the window")

    down_to: int | None = None
    settles_at: int | None = None
    if rcfg.capacity is not None:
        if loads.shares_sizing is None:
            calm.append("load unmeasured")
        else:
            assert sized is not None  # set above whenever the load is measured
            need = sized
            if need > obs.desired_replicas or (obs.desired_replicas == 0 and need > 0):
                wants.append(
                    Want(
                        need,
                        "ForecastLoad",
                        f"{loads.text} needs {need} at {t.target_utilization:.0%} of "
                        f"{rcfg.capacity.source or 'the capacity profile'}{_pooled(loads, t)}",
                        is_reactive=False,
                    )
                )
            if backlog is not None and backlog.replicas > max(need, obs.desired_replicas):
                wants.append(backlog)
            if not calm:
                # The band decides *whether* to shrink (the replicas there run below
                # scale_down_utilization); a shrink lands mid-band (70 %), where noise of
                # either sign leaves the pool inside the band. Landing at the band's edge ran
                # every declining pool at 60 %, a third more replicas than the 80 % target
                # sizes for, through every evening; landing at the target itself put the
                # pool on the edge of a scale-up, which a 5 % rise then crossed.
                #
                # A load that fell at each of the last five intervals is on its way down,
                # not wavering at an edge: the band collapses to the target, and the pool
                # follows the decline at the target's margin (on the way down the band cost
                # every declining pool an eighth to a third more replicas than the target
                # sizes for: it ran between the band's edge and its middle). The
                # stabilization window still holds what the window's loads needed.
                if loads.is_falling:
                    floor = landing = t.replicas_for(loads.shares_sizing, t.target_utilization)
                else:
                    floor = t.replicas_for(loads.shares_sizing, t.scale_down_utilization)
                    mid = (t.target_utilization + t.scale_down_utilization) / 2
                    landing = t.replicas_for(loads.shares_sizing, mid)
                down_to = landing if floor < obs.desired_replicas else floor
                settles_at = landing
    elif not calm:
        # Without a capacity profile only the last saturation says how far the load would
        # stretch fewer replicas: one step down per stabilization window, when all is calm
        # and the rest would stay well under the rate per replica that last broke the SLO.
        down_to = 0 if is_idle else obs.desired_replicas - 1
        rate = obs.request_rate_per_s
        limit = saturation_rate_per_replica
        if not is_idle and limit is not None and rate is not None and down_to > 0:
            per_replica = rate / down_to
            if per_replica > t.saturation_headroom * limit:
                calm.append(
                    f"{down_to} replicas would carry {per_replica:.3g} requests/s each; the "
                    f"SLO broke at {limit:.3g}"
                )
                down_to = None
    if is_idle and obs.desired_replicas == 0:
        down_to = None
    if not is_idle and obs.desired_replicas == 0 and obs.request_rate_per_s is not None:
        wants.append(Want(1, "ForecastLoad", "traffic and no replica", is_reactive=False))
    return Assessment(
        wants=tuple(wants),
        down_to=down_to,
        hold_note="; ".join(calm),
        missing=tuple(dict.fromkeys(missing)),
        is_blind=reading.is_blind,
        draining="; ".join(draining),
        sized=sized,
        settles_at=settles_at,
    )
