"""The planner's decisions: replicas per role from observations and the carried state (pure).

`plan` is the whole public surface (see `types.py` for the contract). For each role:

1. Spec replicas win when autoscaling is off or the role is pinned (manual override).
2. Replicas outside [min, max] (the bounds changed) go to the bound at once.
3. The role's signals (`signals.assess`) ask for replicas; the largest ask wins. A scale-up
   happens at once, unless pods of the role are Pending for lack of resources (more would
   only pend too), the role is at maxReplicas, or a latency-driven ask comes within the
   scale-up cooldown, or while replicas it added are still starting (their capacity is not
   in the latency yet). Capacity-sized asks (the forecast) skip the cooldown: they count
   replicas from the load, not from a latency that new replicas have not touched yet.
4. Otherwise a scale-down to the most replicas wanted over the stabilization window, and
   only after the planner has watched the role for a whole window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from kvflow.operator.planner.forecast import Holt, sizing_load, start_or_update
from kvflow.operator.planner.registry import Want
from kvflow.operator.planner.signals import Assessment, Loads, assess, violation_share
from kvflow.operator.planner.slo import judge_slo
from kvflow.operator.planner.types import (
    Decision,
    DecisionReason,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    RoleConfig,
    RoleState,
    WorkerRole,
)


def plan(
    config: PlannerConfig,
    observations: Mapping[WorkerRole, Observation],
    state: PlannerState,
) -> Plan:
    """Decisions for every configured role that was observed, the SLO verdict, the new state.

    A configured role with no observation gets no decision and keeps its state.
    """
    decisions: list[Decision] = []
    states = {s.role: s for s in state.roles}
    for role, rcfg in config.roles.items():
        obs = observations.get(role)
        if obs is None:
            continue
        role_state, loads = _observe(role, obs, config, rcfg, state.role(role))
        decision, role_state = _decide(role, obs, config, rcfg, role_state, loads)
        decisions.append(decision)
        states[role] = role_state
    return Plan(
        decisions=tuple(decisions),
        slo=judge_slo(config, observations),
        state=PlannerState(roles=tuple(states[r] for r in states)),
    )


def _observe(
    role: WorkerRole,
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    state: RoleState,
) -> tuple[RoleState, Loads]:
    """Fold this interval's loads into the forecasts; the load to size for, in shares."""
    t = config.tuning
    now = obs.time_s
    prompt_load = _prompt_tokens_per_s(obs) if role != "decode" else None
    decode_load = _decode_tokens_per_s(obs) if role != "prefill" else None
    prompt_holt = state.prompt_load
    decode_holt = state.decode_load
    if prompt_load is not None:
        prompt_holt = start_or_update(
            prompt_holt, prompt_load, now, alpha=t.forecast_level_alpha, beta=t.forecast_trend_beta
        )
    if decode_load is not None:
        decode_holt = start_or_update(
            decode_holt, decode_load, now, alpha=t.forecast_level_alpha, beta=t.forecast_trend_beta
        )
    state = replace(
        state,
        prompt_load=prompt_holt,
        decode_load=decode_holt,
        since_s=now if state.since_s is None else state.since_s,
    )
    cap = rcfg.capacity
    horizon_s = config.replica_startup_s + config.interval_s

    def sized(load: float, holt: Holt) -> float:
        return sizing_load(
            load,
            holt,
            horizon_s,
            max_growth=t.max_forecast_growth,
            damping_s=t.forecast_damping_s,
            sample_window_s=config.interval_s,  # a load sample is a rate over an interval
        )

    shares_now = shares_sizing = 0.0
    parts: list[str] = []
    if cap is None:
        return state, Loads(None, None, "")
    is_falling = True  # on every side the role serves
    if role != "decode":
        if prompt_load is None or prompt_holt is None:
            return state, Loads(None, None, "")
        ahead = sized(prompt_load, prompt_holt)
        shares_now += prompt_load / cap.max_prompt_tokens_per_s
        shares_sizing += ahead / cap.max_prompt_tokens_per_s
        parts.append(f"prompt load {prompt_load:.0f} tokens/s ({ahead:.0f} ahead)")
        is_falling = is_falling and prompt_holt.is_falling
    if role != "prefill":
        if decode_load is None or decode_holt is None:
            return state, Loads(None, None, "")
        ahead = sized(decode_load, decode_holt)
        shares_now += decode_load / cap.max_decode_tokens_per_s
        shares_sizing += ahead / cap.max_decode_tokens_per_s
        parts.append(f"output {decode_load:.0f} tokens/s ({ahead:.0f} ahead)")
        is_falling = is_falling and decode_holt.is_falling
    if is_falling:
        parts.append("falling for five intervals")
    return state, Loads(shares_now, shares_sizing, ", ".join(parts), is_falling=is_falling)


def _prompt_tokens_per_s(obs: Observation) -> float | None:
    if obs.request_rate_per_s == 0:
        return 0.0
    if obs.request_rate_per_s is None or obs.mean_input_tokens is None:
        return None
    return obs.request_rate_per_s * obs.mean_input_tokens


def _decode_tokens_per_s(obs: Observation) -> float | None:
    """Output tokens/s the role is asked for: arrivals x output tokens.

    Counted from the arrivals, not from what runs: a saturated role runs no more than its
    batch limit and hides the rest in its queue, and a role draining a backlog runs more
    than arrives (sizing for it buys replicas that start after the backlog is gone). When
    the rate or the lengths are unmeasured, what runs: decoding requests / TPOT.
    """
    if obs.request_rate_per_s == 0:
        return 0.0
    if obs.request_rate_per_s is not None and obs.mean_output_tokens is not None:
        return obs.request_rate_per_s * obs.mean_output_tokens
    if obs.decode_batch_size is not None and obs.tpot_s:
        return obs.decode_batch_size * obs.ready_replicas / obs.tpot_s
    return None


_SATURATED: frozenset[DecisionReason] = frozenset({"TtftViolation", "TpotViolation", "QueueWait"})


def _saturation(obs: Observation, state: RoleState, step: _Step) -> float | None:
    """Requests/s per ready replica at this interval's SLO break, else the last one's."""
    rate = obs.request_rate_per_s
    if step.saturated and rate is not None and rate > 0 and obs.ready_replicas > 0:
        return rate / obs.ready_replicas
    return state.saturation_rate_per_replica


@dataclass(frozen=True)
class _Step:
    """What `_choose` settled on, before it becomes a Decision and a new RoleState."""

    replicas: int
    reason: DecisionReason
    message: str
    wanted: int | None = None  # recorded for stabilization; None: `replicas`
    is_up: bool = False
    is_down: bool = False
    saturated: bool = False  # a latency or queue signal was over its threshold


def _decide(
    role: WorkerRole,
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    state: RoleState,
    loads: Loads,
) -> tuple[Decision, RoleState]:
    now = obs.time_s
    step = _choose(role, obs, config, rcfg, state, loads)
    recent = tuple(
        (t, r) for t, r in state.recommendations if t >= now - config.scale_down_stabilization_s
    )
    wanted = step.replicas if step.wanted is None else step.wanted
    new_state = replace(
        state,
        saturation_rate_per_replica=_saturation(obs, state, step),
        last_violation_share=violation_share(obs),
        replicas=step.replicas,
        recommendations=(*recent, (now, wanted)),
        last_scale_up_s=now if step.is_up else state.last_scale_up_s,
        last_scale_down_s=now if step.is_down else state.last_scale_down_s,
    )
    current = obs.desired_replicas
    message = f"{role} {current}->{step.replicas}: {step.message}"
    return Decision(role, step.replicas, current, step.reason, message), new_state


def _choose(
    role: WorkerRole,
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    state: RoleState,
    loads: Loads,
) -> _Step:
    current = obs.desired_replicas
    if not config.enabled:
        return _Step(rcfg.spec_replicas, "AutoscalingDisabled", "spec replicas (autoscaling off)")
    if not rcfg.is_autoscaled:
        return _Step(rcfg.spec_replicas, "ManualOverride", "spec replicas (manual override)")
    if current < rcfg.min_replicas:
        return _Step(rcfg.min_replicas, "BelowMinReplicas", "raised to minReplicas")
    if current > rcfg.max_replicas:
        return _Step(rcfg.max_replicas, "AboveMaxReplicas", "lowered to maxReplicas")

    found = assess(
        role,
        obs,
        config,
        rcfg,
        loads,
        state.saturation_rate_per_replica,
        state.last_violation_share,
        _starting_for_s(obs, config, state),
    )
    step = _choose_autoscaled(obs, config, rcfg, state, loads, found)
    return replace(step, saturated=any(w.reason in _SATURATED for w in found.wants))


def _starting_for_s(obs: Observation, config: PlannerConfig, state: RoleState) -> float | None:
    """Seconds until the replicas still starting serve: a start-up after the last scale-up
    (None when unknown, e.g. after an operator restart)."""
    if state.last_scale_up_s is None:
        return None
    return max(0.0, state.last_scale_up_s + config.replica_startup_s - obs.time_s)


def _choose_autoscaled(
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    state: RoleState,
    loads: Loads,
    found: Assessment,
) -> _Step:
    current = obs.desired_replicas
    note = f" [missing: {', '.join(found.missing)}]" if found.missing else ""
    best = _largest(found.wants, current)
    if best is not None:
        return _scale_up(obs, config, rcfg, state, found, best, note)
    if found.draining and not found.wants:
        # Remembered as what the load needs, not as the replicas held for the drain: once
        # the latency is calm they may go without a stabilization window of the drain.
        wanted = None if found.sized is None else min(found.sized, current)
        return _Step(current, "BacklogDraining", f"{found.draining}{note}", wanted=wanted)
    if found.wants:  # over a threshold, but what was asked for is already on its way
        pressing = max(found.wants, key=lambda w: w.replicas)
        starting = obs.pending_replicas - obs.unschedulable_replicas
        if obs.unschedulable_replicas > 0:
            return _Step(
                current,
                "PendingPods",
                f"{pressing.detail}, and {obs.unschedulable_replicas} pod(s) are Pending for "
                f"lack of resources (GPUs?): not adding more until they schedule{note}",
            )
        if starting > 0:
            return _Step(
                current,
                "Cooldown",
                f"{pressing.detail}; waiting: {starting} replica(s) still starting{note}",
            )
    want = None if found.down_to is None else max(found.down_to, rcfg.min_replicas)
    if want is not None and want < current:
        return _scale_down(obs, config, state, loads, want, note)
    if found.is_blind:
        return _Step(current, "MetricsMissing", f"holding: latency unmeasured{note}")
    # Inside the band the window remembers what the load needs (the landing), not the
    # replicas held, as HPA remembers its recommendations: when the band is crossed after a
    # long decline the shrink need not wait a whole window more. Over the window's maximum
    # it still never shrinks below what any interval in it wanted.
    wanted = None if found.settles_at is None else min(found.settles_at, current)
    return _Step(
        current,
        "Steady",
        f"{found.hold_note or 'within the hysteresis band'}{note}",
        wanted=wanted,
    )


def _largest(wants: tuple[Want, ...], current: int) -> Want | None:
    """The ask for the most replicas above `current`; on a tie, a measured one."""
    over = [w for w in wants if w.replicas > current]
    return max(over, key=lambda w: (w.replicas, w.is_reactive)) if over else None


def _scale_up(
    obs: Observation,
    config: PlannerConfig,
    rcfg: RoleConfig,
    state: RoleState,
    found: Assessment,
    best: Want,
    note: str,
) -> _Step:
    current = obs.desired_replicas
    target = min(best.replicas, rcfg.max_replicas)
    if target <= current:
        return _Step(
            current,
            "AtMaxReplicas",
            f"{best.detail}, but maxReplicas is {rcfg.max_replicas}{note}",
            wanted=target,
        )
    if obs.unschedulable_replicas > 0:
        return _Step(
            current,
            "PendingPods",
            f"{best.detail}, but {obs.unschedulable_replicas} pod(s) are Pending for lack of "
            f"resources (GPUs?): not adding more until they schedule{note}",
        )
    if best.is_reactive and _in_cooldown(obs, config, state):
        sized = _largest(tuple(w for w in found.wants if not w.is_reactive), current)
        if sized is None:
            starting = obs.pending_replicas - obs.unschedulable_replicas
            last_up_s = state.last_scale_up_s if state.last_scale_up_s is not None else 0.0
            why = (
                f"{starting} replica(s) still starting"
                if starting > 0
                else f"the last scale-up was {obs.time_s - last_up_s:.0f} s ago "
                f"(cooldown {config.scale_up_cooldown_s:.0f} s)"
            )
            return _Step(current, "Cooldown", f"{best.detail}; waiting: {why}{note}", wanted=target)
        best, target = sized, min(sized.replicas, rcfg.max_replicas)
    capped = f" (capped at maxReplicas {rcfg.max_replicas})" if target < best.replicas else ""
    # A backlog's extra replicas are remembered as what the load needs: once the queue is
    # drained they may go without a stabilization window of the backlog's size.
    wanted = None if best.sustained is None else min(best.sustained, target)
    return _Step(target, best.reason, f"{best.detail}{capped}{note}", wanted=wanted, is_up=True)


def _in_cooldown(obs: Observation, config: PlannerConfig, state: RoleState) -> bool:
    if state.last_scale_up_s is None:
        return False
    since_s = obs.time_s - state.last_scale_up_s
    if since_s < config.scale_up_cooldown_s:
        return True
    # Replicas it added are still starting: the latency has not seen them. Bounded by twice
    # the start-up time, so a pod that never turns ready does not freeze the role.
    starting = obs.pending_replicas - obs.unschedulable_replicas
    return starting > 0 and since_s < 2 * config.replica_startup_s


def _scale_down(
    obs: Observation,
    config: PlannerConfig,
    state: RoleState,
    loads: Loads,
    want: int,
    note: str,
) -> _Step:
    now = obs.time_s
    current = obs.desired_replicas
    window_s = config.scale_down_stabilization_s
    stable = max([want, *(r for t, r in state.recommendations if t >= now - window_s)])
    watched_s = now - (state.since_s if state.since_s is not None else now)
    why = loads.text or "latency, queue wait and KV calm"
    if watched_s < window_s:
        return _Step(
            current,
            "Stabilizing",
            f"{why}: {want} would do; watched {watched_s:.0f} of {window_s:.0f} s{note}",
            wanted=want,
        )
    if stable >= current:
        return _Step(
            current,
            "Stabilizing",
            f"{why}: {want} would do, but {stable} was wanted within {window_s:.0f} s{note}",
            wanted=want,
        )
    return _Step(stable, "Underloaded", f"{why}{note}", wanted=want, is_down=True)
