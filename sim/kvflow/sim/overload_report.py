"""The overload scenario's numbers: per class and per arm, goodput, the ladder's moves.

Goodput is the requests that met both their class's TTFT and TPOT targets, per second of
the window they arrived in; a refused request never meets them. Its ceiling is every
request offered in the window served within its targets: the ratio on / off cannot pass
the offered rate over the off arm's goodput. Numbers are given for the
overload phase (the arrivals while the offered load was above the capacity: the claim)
and for the whole run. TTFT and TPOT percentiles are of the requests that were served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvflow.loadgen.metrics import percentiles
from kvflow.proto.priority_class import CLASS_WORDS
from kvflow.router.degrade.ladder import LadderConfig
from kvflow.sim.overload import ArmResult, Outcome, OverloadResult
from kvflow.sim.overload_traffic import LoadPhase, load_at

GOODPUT_BIN_S = 10.0


def overload_window(phases: Sequence[LoadPhase]) -> tuple[float, float]:
    """[start, end) of the phases above capacity (the first to the last)."""
    start_s, lo, hi = 0.0, None, None
    for phase in phases:
        if phase.load > 1.0:
            lo = start_s if lo is None else lo
            hi = start_s + phase.duration_s
        start_s += phase.duration_s
    if lo is None or hi is None:
        return 0.0, start_s
    return lo, hi


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 2)


def class_summary(outcomes: Sequence[Outcome], window_s: float) -> dict[str, Any]:
    served = [o for o in outcomes if o.record.is_ok]
    ttft = percentiles(t for o in served if (t := o.record.ttft_s) is not None)
    tpot = percentiles(t for o in served if (t := o.record.tpot_s) is not None)
    good = sum(1 for o in outcomes if o.meets_slo)
    return {
        "offered": len(outcomes),
        "served": len(served),
        "shed": sum(1 for o in outcomes if o.is_shed),
        "held": sum(1 for o in outcomes if o.held_s > 0),
        "capped": sum(1 for o in outcomes if o.is_capped),
        "ttft_p50_ms": _ms(ttft.p50),
        "ttft_p99_ms": _ms(ttft.p99),
        "tpot_p50_ms": _ms(tpot.p50),
        "tpot_p99_ms": _ms(tpot.p99),
        "slo_attainment": good / len(outcomes) if outcomes else None,
        "goodput_per_s": good / window_s if window_s > 0 else 0.0,
        "output_tokens": sum(o.record.num_output_tokens for o in served),
    }


def arm_summary(arm: ArmResult, lo_s: float, hi_s: float) -> dict[str, Any]:
    inside = [o for o in arm.outcomes if lo_s <= o.record.sent_s < hi_s]
    by_class = {
        word: class_summary([o for o in inside if o.priority_class.value == word], hi_s - lo_s)
        for word in CLASS_WORDS
    }
    total = class_summary(inside, hi_s - lo_s)
    return {"classes": by_class, "total": total}


def goodput_series(arm: ArmResult, end_s: float) -> list[dict[str, float]]:
    """Goodput per ``GOODPUT_BIN_S`` of arrivals: the plot's lines."""
    bins = max(1, int(end_s // GOODPUT_BIN_S) + (end_s % GOODPUT_BIN_S > 0))
    good = [0] * bins
    for o in arm.outcomes:
        i = int(o.record.sent_s // GOODPUT_BIN_S)
        if 0 <= i < bins and o.meets_slo:
            good[i] += 1
    return [{"at_s": i * GOODPUT_BIN_S, "goodput_per_s": g / GOODPUT_BIN_S}
            for i, g in enumerate(good)]  # fmt: skip


def report_dict(result: OverloadResult) -> dict[str, Any]:
    config = result.config
    lo_s, hi_s = overload_window(config.phases)
    end_s = config.duration_s
    arms: dict[str, Any] = {}
    for arm in result.arms:
        arms[arm.name] = {
            "overload_phase": arm_summary(arm, lo_s, hi_s),
            "whole_run": arm_summary(arm, 0.0, end_s),
            "transitions": [
                {
                    "at_s": round(t.at_s, 3),
                    "step": t.step.value,
                    "action": t.action,
                    "level": t.level,
                    "reason": t.reason,
                }
                for t in arm.transitions
            ],
            "levels": [
                {
                    "at_s": round(s.at_s, 3),
                    "level": s.level,
                    "ttft_burn": round(s.signals.ttft_burn, 3),
                    "tpot_burn": round(s.signals.tpot_burn, 3),
                    "queue_p90_s": round(s.signals.queue_p90_s, 3),
                    "requests": s.signals.requests,
                    "offered_per_s": round(s.signals.offered_per_s, 3),
                }
                for s in arm.levels
            ],
            "goodput_series": goodput_series(arm, end_s),
            "wall_s": round(arm.wall_s, 2),
        }
    off = arms.get("off", {}).get("overload_phase", {}).get("total", {}).get("goodput_per_s")
    on = arms.get("on", {}).get("overload_phase", {}).get("total", {}).get("goodput_per_s")
    offered_per_s = result.num_in_window(lo_s, hi_s) / (hi_s - lo_s) if hi_s > lo_s else 0.0
    gw = config.gateway
    ladder = gw.ladder
    return {
        "scenario": "overload",
        "config": {
            "mix_name": config.scenario,
            "profile": config.profile.name,
            "max_num_seqs": config.profile.max_num_seqs,
            "max_num_batched_tokens": config.profile.max_num_batched_tokens,
            "num_workers": config.num_workers,
            "routing_arm": config.routing_arm,
            "seed": config.seed,
            "phases": [{"duration_s": p.duration_s, "load": p.load} for p in config.phases],
            "mix": [
                {
                    "tenant": t.tenant,
                    "class": t.priority_class.value,
                    "share": t.share,
                    "prompt_tokens": t.prompt_tokens,
                    "output_tokens": t.output_tokens,
                    "slo_ttft_s": t.slo.ttft_s,
                    "slo_tpot_s": t.slo.tpot_s,
                }
                for t in config.mix
            ],
            "gateway": {
                "shed_wait_s": {c.value: s for c, s in gw.shed_wait_s.items()},
                "max_tokens_cap": gw.max_tokens_cap,
                "hold_share_of_ttft": gw.hold_share_of_ttft,
                "window_s": gw.window_s,
                "evaluate_interval_s": gw.evaluate_interval_s,
                "ladder": None if ladder is None else _ladder_dict(ladder),
            },
        },
        "capacity_per_s": round(result.capacity_per_s, 3),
        "capacity_measured": None if result.capacity is None else result.capacity.as_dict(),
        "num_arrivals": result.num_arrivals,
        "overload_window_s": [lo_s, hi_s],
        "goodput_ratio_on_off": (on / off) if on is not None and off else None,
        "offered_per_s": round(offered_per_s, 3),
        "goodput_ceiling_on_off": (offered_per_s / off) if off else None,
        "ladder_moves": ladder_moves(arms["on"]["transitions"]) if "on" in arms else None,
        "arms": arms,
        "targets": targets(result, arms),
    }


def ladder_moves(transitions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The on arm's ladder in counts: steps engaged and released, and its reversals (a step
    engaged again after the ladder had released it: the release came too early)."""
    released: set[str] = set()
    reversals = 0
    for t in transitions:
        if t["action"] == "released":
            released.add(t["step"])
        elif t["step"] in released:
            reversals += 1
    return {
        "engaged": sum(1 for t in transitions if t["action"] == "engaged"),
        "released": sum(1 for t in transitions if t["action"] == "released"),
        "reversals": reversals,
        "max_level": max((t["level"] for t in transitions), default=0),
    }


def _ladder_dict(ladder: LadderConfig) -> dict[str, Any]:
    return {
        "steps": [s.value for s in ladder.steps],
        "engage_burn": ladder.engage_burn,
        "release_burn": ladder.release_burn,
        "engage_queue_s": ladder.engage_queue_s,
        "release_queue_s": ladder.release_queue_s,
        "engage_after_s": ladder.engage_after_s,
        "release_after_s": ladder.release_after_s,
        "reengage_window_s": ladder.reengage_window_s,
        "max_release_after_s": ladder.max_release_after_s,
        "release_offered_ratio": ladder.release_offered_ratio,
        "min_requests": ladder.min_requests,
    }


def targets(result: OverloadResult, arms: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's two targets, judged on the overload phase."""
    out: list[dict[str, Any]] = []
    rt = next((t for t in result.config.mix if t.priority_class.value == "realtime"), None)
    if "on" in arms and rt is not None:
        p99 = arms["on"]["overload_phase"]["classes"]["realtime"]["ttft_p99_ms"]
        out.append({
            "name": "realtime TTFT P99 within its SLO, degradation on",
            "met": p99 is not None and p99 <= rt.slo.ttft_s * 1e3,
            "value_ms": p99, "target_ms": rt.slo.ttft_s * 1e3,
        })  # fmt: skip
    if "on" in arms and "off" in arms:
        off = arms["off"]["overload_phase"]["total"]["goodput_per_s"]
        on = arms["on"]["overload_phase"]["total"]["goodput_per_s"]
        ratio = on / off if off else None
        out.append({"name": "goodput on / off >= 1.5", "met": ratio is not None and ratio >= 1.5,
                    "value": ratio, "target": 1.5})  # fmt: skip
    return out


def render(report: dict[str, Any]) -> str:
    """Markdown: per arm and class, the overload phase; then the targets and the ladder."""
    lo, hi = report["overload_window_s"]
    lines = [
        f"mix {report['config']['mix_name']}: "
        + ", ".join(
            f"{t['class']} {t['share']:.0%} {t['prompt_tokens']}/{t['output_tokens']}"
            for t in report["config"]["mix"]
        ),
        f"capacity {report['capacity_per_s']:.2f} req/s; overload phase {lo:.0f}-{hi:.0f} s "
        f"({report['num_arrivals']} arrivals in all)",
        "",
        "| arm | class | offered | shed | capped | held | TTFT P50 / P99 ms | "
        "TPOT P50 / P99 ms | SLO met | goodput req/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, arm in report["arms"].items():
        phase = arm["overload_phase"]
        for word, c in [*phase["classes"].items(), ("all", phase["total"])]:
            att = c["slo_attainment"]
            lines.append(
                f"| {name} | {word} | {c['offered']} | {c['shed']} | {c['capped']} | "
                f"{c['held']} | {_fmt(c['ttft_p50_ms'])} / {_fmt(c['ttft_p99_ms'])} | "
                f"{_fmt(c['tpot_p50_ms'])} / {_fmt(c['tpot_p99_ms'])} | "
                f"{'-' if att is None else f'{att:.1%}'} | {c['goodput_per_s']:.2f} |"
            )
    ratio, ceiling = report["goodput_ratio_on_off"], report["goodput_ceiling_on_off"]
    lines += [
        "",
        f"goodput on / off: {'-' if ratio is None else f'{ratio:.2f}'}x (ceiling "
        f"{'-' if ceiling is None else f'{ceiling:.2f}'}x: all "
        f"{report['offered_per_s']:.2f} req/s offered served within their targets)",
        "",
    ]
    for t in report["targets"]:
        lines.append(f"- [{'x' if t['met'] else ' '}] {t['name']}: "
                     f"{t.get('value_ms', t.get('value'))}")  # fmt: skip
    on = report["arms"].get("on")
    if on is not None:
        moves = report["ladder_moves"]
        lines += [
            "",
            f"ladder (degradation on): {moves['engaged']} engaged, "
            f"{moves['released']} released, {moves['reversals']} reversals",
        ]
        lines += [f"- {t['at_s']:.0f} s: {t['action']} {t['step']} (level {t['level']}; "
                  f"{t['reason']})" for t in on["transitions"]]  # fmt: skip
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(report: dict[str, Any], path: str) -> None:
    """Offered load, the ladder's level and goodput per arm over time, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    config = report["config"]
    phases = [LoadPhase(p["duration_s"], p["load"]) for p in config["phases"]]
    end_s = sum(p.duration_s for p in phases)
    fig, (ax_load, ax_level, ax_good) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ts = [i * 0.5 for i in range(int(end_s * 2) + 1)]
    ax_load.step(ts, [load_at(phases, t) for t in ts], where="post", color="black")
    ax_load.axhline(1.0, color="grey", ls=":", label="capacity")
    ax_load.set(ylabel="offered load\n(x capacity)",
                title=f"overload ({config.get('mix_name', 'batch-heavy')}): "
                f"{config['num_workers']} x {config['profile']} "
                f"(max_num_seqs {config['max_num_seqs']}), virtual time")  # fmt: skip
    ax_load.legend(fontsize=8)
    for name, arm in report["arms"].items():
        levels = arm["levels"]
        ax_level.step([s["at_s"] for s in levels], [s["level"] for s in levels], where="post",
                      label=f"degradation {name}")  # fmt: skip
        series = arm["goodput_series"]
        ax_good.step([s["at_s"] for s in series], [s["goodput_per_s"] for s in series],
                     where="post", label=f"degradation {name}")  # fmt: skip
    on = report["arms"].get("on")
    steps = (config["gateway"]["ladder"] or {}).get("steps", [])
    if on is not None:
        for t in on["transitions"]:
            marker = "^" if t["action"] == "engaged" else "v"
            ax_level.plot([t["at_s"]], [t["level"]], marker, color="C1", markersize=6)
    ax_level.set(ylabel="ladder level", yticks=range(len(steps) + 1),
                 yticklabels=["none", *steps])  # fmt: skip
    ax_level.legend(fontsize=8)
    ax_good.set(ylabel=f"goodput (req/s,\n{GOODPUT_BIN_S:.0f} s bins)", xlabel="time (s)")
    ax_good.axhline(report["capacity_per_s"], color="grey", ls=":", label="capacity")
    ax_good.legend(fontsize=8)
    lo, hi = report["overload_window_s"]
    for ax in (ax_load, ax_level, ax_good):
        ax.axvspan(lo, hi, color="red", alpha=0.05)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
