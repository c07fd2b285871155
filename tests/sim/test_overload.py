"""The overload scenario, short: a small pool at twice its capacity, degradation off and on.

The mechanism, not the published numbers (docs/benchmarks.md has the full runs): admission
sheds batch before realtime, the ladder engages under the overload and releases after
it, and goodput with degradation on beats off on the same arrivals, whether the overload
is batch's (the default mix) or the interactive classes' own (``interactive-heavy``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from functools import cache
from pathlib import Path

import pytest

from kvflow.cli.sim import main as sim_main
from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.proto.priority_class import PriorityClass
from kvflow.router.degrade.ladder import LadderConfig
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import WorkerQueue
from kvflow.router.settings import parse_config
from kvflow.sim.overload import OverloadConfig, OverloadResult, run_overload
from kvflow.sim.overload_cli import config_from, parser
from kvflow.sim.overload_gateway import (
    DEFAULT_STEPS,
    Decision,
    GatewayConfig,
    OverloadGateway,
)
from kvflow.sim.overload_report import ladder_moves, report_dict
from kvflow.sim.overload_traffic import (
    CLASS_SLOS,
    DEFAULT_MIX,
    INTERACTIVE_MIX,
    SCENARIOS,
    ClassSlo,
    LoadPhase,
    TenantTraffic,
    parse_mix,
)

REALTIME, NORMAL, BATCH = PriorityClass.REALTIME, PriorityClass.NORMAL, PriorityClass.BATCH

# The default mix's shape at a quarter of its lengths; a worker of 16 sequences.
SMALL_MIX = (
    TenantTraffic("chat", REALTIME, 0.15, 64, 16, ClassSlo(1.0, 0.10)),
    TenantTraffic("app", NORMAL, 0.15, 128, 32, ClassSlo(3.0, 0.15)),
    TenantTraffic("reports", BATCH, 0.70, 256, 256, ClassSlo(30.0, 0.30)),
)
# interactive-heavy's shape at a quarter of its lengths: the normal tenant's long answers
# are the overload.
SMALL_INTERACTIVE_MIX = (
    TenantTraffic("chat", REALTIME, 0.15, 64, 16, CLASS_SLOS[REALTIME]),
    TenantTraffic("assistant", NORMAL, 0.70, 128, 192, CLASS_SLOS[NORMAL]),
    TenantTraffic("reports", BATCH, 0.15, 256, 256, CLASS_SLOS[BATCH]),
)
PHASES = (LoadPhase(5.0, 0.5), LoadPhase(30.0, 2.0), LoadPhase(25.0, 0.5))
FAST_LADDER = LadderConfig(DEFAULT_STEPS, engage_after_s=2.0, release_after_s=8.0)


def small_config() -> OverloadConfig:
    profile = dataclasses.replace(resolve_profile("h100-llama3-8b"), max_num_seqs=16,
                                  max_num_batched_tokens=512)  # fmt: skip
    gateway = GatewayConfig(ladder=FAST_LADDER, max_tokens_cap=64, window_s=5.0)
    return OverloadConfig(profile, num_workers=1, mix=SMALL_MIX, phases=PHASES,
                          gateway=gateway, capacity_requests=80)  # fmt: skip


@cache
def small_run() -> OverloadResult:
    return run_overload(small_config())


@cache
def small_interactive_run() -> OverloadResult:
    config = dataclasses.replace(small_config(), mix=SMALL_INTERACTIVE_MIX,
                                 scenario="interactive-heavy")  # fmt: skip
    return run_overload(config)


def test_batch_is_shed_before_realtime() -> None:
    result = small_run()
    off = result.arm("off").outcomes
    shed = [o for o in off if o.is_shed]
    assert shed, "the overload never filled the pool"
    assert shed[0].priority_class is BATCH
    by_class = {c: sum(1 for o in shed if o.priority_class is c) for c in PriorityClass}
    assert by_class[BATCH] > 0 and by_class[REALTIME] == 0, by_class


def test_the_ladder_engages_under_overload_and_releases_after() -> None:
    result = small_run()
    assert result.arm("off").transitions == []
    on = result.arm("on").transitions
    engaged = [t for t in on if t.action == "engaged"]
    released = [t for t in on if t.action == "released"]
    assert engaged and 5.0 <= engaged[0].at_s < 35.0, on
    assert [t.step for t in engaged[:1]] == [DEFAULT_STEPS[0]]  # the cheapest step first
    assert released and released[-1].at_s > engaged[0].at_s
    assert result.arm("on").levels[-1].level < max(t.level for t in engaged)


def test_goodput_with_degradation_beats_without() -> None:
    report = report_dict(small_run())
    phase = {name: arm["overload_phase"] for name, arm in report["arms"].items()}
    assert phase["on"]["total"]["goodput_per_s"] > phase["off"]["total"]["goodput_per_s"]
    assert phase["on"]["classes"]["batch"]["capped"] > 0  # cap_max_tokens did apply
    assert report["goodput_ratio_on_off"] > 1.0
    assert {t["name"] for t in report["targets"]} == {
        "realtime TTFT P99 within its SLO, degradation on",
        "goodput on / off >= 1.5",
    }
    json.dumps(report, allow_nan=False)  # the published form holds no NaN


def queue(waiting: int, rate_per_s: float = 1.0) -> WorkerQueue:
    return WorkerQueue(WorkerId("w"), waiting, 0, rate_per_s)


def test_classes_are_refused_in_shed_order_and_held_when_queueing_is_on() -> None:
    slos = {t.priority_class: t.slo for t in DEFAULT_MIX}
    gateway = OverloadGateway(GatewayConfig(), slos)
    # 4 s of estimated wait: past batch's 2 s, under normal's 6 s and realtime's 30 s.
    decisions = {c: gateway.decide(c, [queue(4)], 0) for c in PriorityClass}
    assert decisions == {BATCH: Decision.SHED, NORMAL: Decision.ADMIT, REALTIME: Decision.ADMIT}
    assert gateway.decide(NORMAL, [queue(7)], 0) is Decision.SHED
    gateway.ladder.level = len(DEFAULT_STEPS)  # every step on
    assert gateway.decide(BATCH, [queue(4)], 0) is Decision.HOLD
    assert gateway.max_tokens(1024) == 256 and gateway.max_tokens(64) == 64
    assert gateway.hold_deadline_s(REALTIME, 10.0) == pytest.approx(10.5)


def test_the_scenario_runs_the_gateways_ladder_defaults() -> None:
    # The published figures are claimed for an unconfigured gateway's ladder: same
    # thresholds, dwells, re-engage back-off and window as degrade/config.py's defaults.
    spec = parse_config(
        {"degradation": {"m": {"steps": ["drop_extras"], "ttft_slo_s": 1, "tpot_slo_s": 1}}}
    ).degradation["m"]
    args = parser().parse_args([])
    ladder = config_from(args).gateway.ladder
    assert ladder == dataclasses.replace(spec.ladder, steps=DEFAULT_STEPS)
    assert GatewayConfig().ladder == ladder
    assert args.window_s == GatewayConfig().window_s == spec.window_s


def test_shed_waits_must_rise_in_shed_order() -> None:
    with pytest.raises(ValueError, match="rise in the shed order"):
        GatewayConfig(shed_wait_s={BATCH: 5.0, NORMAL: 2.0, REALTIME: 30.0})


def test_cli_runs_and_refuses_bad_options(tmp_path: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = sim_main(["overload", "--shed-wait-s", "5", "2", "30"], out, err)
    assert code == 2 and "rise in the shed order" in err.getvalue()
    out_json, out_png = tmp_path / "o.json", tmp_path / "o.png"
    argv = ["overload", "--workers", "1", "--max-num-seqs", "8", "--capacity-per-s", "2",
            "--calm-before-s", "2", "--overload-s", "6", "--calm-after-s", "2",
            "--json", str(out_json), "--plot", str(out_png)]  # fmt: skip
    code = sim_main(argv, out, err)
    assert code == 0, err.getvalue()
    report = json.loads(out_json.read_text())
    assert set(report["arms"]) == {"off", "on"} and out_png.stat().st_size > 0
    assert "goodput on / off" in out.getvalue()


def test_interactive_overload_keeps_realtime_on_target_and_the_ladder_gains() -> None:
    # The overload is the normal class's own: the class scheduler cannot order it against
    # itself, so the off arm serves most normal requests late; the ladder's cap shortens
    # them and the on arm serves more within their targets. Realtime stays on target.
    report = report_dict(small_interactive_run())
    assert report["config"]["mix_name"] == "interactive-heavy"
    phase = {name: arm["overload_phase"] for name, arm in report["arms"].items()}
    realtime_on = phase["on"]["classes"]["realtime"]
    assert realtime_on["shed"] == 0
    assert realtime_on["ttft_p99_ms"] <= CLASS_SLOS[REALTIME].ttft_s * 1e3
    normal = {name: p["classes"]["normal"]["slo_attainment"] for name, p in phase.items()}
    assert normal["off"] < 0.5, normal  # the overload reached the interactive class
    assert normal["on"] > normal["off"], normal
    assert phase["on"]["total"]["goodput_per_s"] > phase["off"]["total"]["goodput_per_s"]
    assert 1.0 < report["goodput_ratio_on_off"] <= report["goodput_ceiling_on_off"]
    assert report["ladder_moves"]["engaged"] >= 1


def test_ladder_moves_count_a_step_taken_again_after_its_release() -> None:
    def move(step: str, action: str, level: int) -> dict[str, object]:
        return {"step": step, "action": action, "level": level}

    moves = ladder_moves([move("cap", "engaged", 1), move("extras", "engaged", 2),
                          move("extras", "released", 1), move("extras", "engaged", 2),
                          move("extras", "released", 1), move("cap", "released", 0)])  # fmt: skip
    assert moves == {"engaged": 3, "released": 3, "reversals": 1, "max_level": 2}
    assert ladder_moves([])["reversals"] == 0


def test_the_named_scenarios_and_a_mix_of_ones_own() -> None:
    assert SCENARIOS["batch-heavy"] == DEFAULT_MIX
    assert config_from(parser().parse_args([])).mix == DEFAULT_MIX
    config = config_from(parser().parse_args(["--scenario", "interactive-heavy"]))
    assert (config.mix, config.scenario) == (INTERACTIVE_MIX, "interactive-heavy")
    text = "realtime:0.15:256:64, normal:0.7:512:768, batch:0.15:1024:1024"
    mix = parse_mix(text)
    assert [(t.priority_class, t.share, t.prompt_tokens, t.output_tokens) for t in mix] == [
        (REALTIME, 0.15, 256, 64), (NORMAL, 0.7, 512, 768), (BATCH, 0.15, 1024, 1024)
    ]  # fmt: skip
    assert [t.slo for t in mix] == [CLASS_SLOS[c] for c in (REALTIME, NORMAL, BATCH)]
    config = config_from(parser().parse_args(["--mix", text]))
    assert (config.mix, config.scenario) == (mix, "custom")
    assert parse_mix("flex:1:10:10")[0].priority_class is BATCH  # a service_tier word


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the mix is empty"),
        ("realtime:1:256", "has 3 fields"),
        ("vip:1:256:64", "mix entry 'vip:1:256:64': unknown priority class 'vip'"),
        ("realtime:half:256:64", "the share 'half' is not a number"),
        ("realtime:1:256.5:64", "the prompt tokens '256.5' is not a whole number"),
        ("realtime:1:256:0", "token counts must be >= 1"),
        ("realtime:0:256:64,batch:1:1:1", "the share must be in (0, 1], got 0"),
        ("realtime:nan:256:64", "the share must be in (0, 1], got nan"),
        ("realtime:0.5:1:1,realtime:0.5:1:1", "the class realtime appears twice"),
        ("realtime:0.5:1:1,batch:0.4:1:1", "shares must sum to 1, got 0.9"),
    ],
)
def test_a_bad_mix_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_mix(text)
    out, err = io.StringIO(), io.StringIO()
    assert sim_main(["overload", "--mix", text], out, err) == 2
    assert message in err.getvalue() and out.getvalue() == ""


def test_a_mix_and_a_scenario_together_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--scenario", "interactive-heavy", "--mix", "batch:1:1:1"])
    assert exc.value.code == 2
