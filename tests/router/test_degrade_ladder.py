"""The degradation ladder climbs one step per hot dwell and reverts one per calm dwell."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvflow.router.degrade.ladder import DegradationLadder, LadderConfig, Step
from kvflow.router.degrade.signals import SloSignals, SloTargets, SloWindow

HOT = SloSignals(ttft_burn=5.0, tpot_burn=0.0, queue_p90_s=0.0, requests=50)
WARM = SloSignals(ttft_burn=1.0, tpot_burn=0.0, queue_p90_s=0.0, requests=50)
CALM = SloSignals(ttft_burn=0.1, tpot_burn=0.1, queue_p90_s=0.1, requests=50)
STEPS = (Step.CAP_MAX_TOKENS, Step.DROP_EXTRAS, Step.FALLBACK_MODEL)


def ladder() -> DegradationLadder:
    return DegradationLadder(LadderConfig(steps=STEPS, engage_after_s=10, release_after_s=30))


def test_hot_signals_take_one_step_per_dwell_in_order() -> None:
    lad = ladder()
    assert lad.observe(0, HOT) is None
    assert lad.observe(9, HOT) is None
    t = lad.observe(10, HOT)
    assert t is not None and (t.step, t.action, t.level) == (Step.CAP_MAX_TOKENS, "engaged", 1)
    assert lad.observe(15, HOT) is None  # the next step waits a full dwell
    t = lad.observe(20, HOT)
    assert t is not None and t.step is Step.DROP_EXTRAS
    lad.observe(30, HOT)
    assert lad.active == STEPS
    assert lad.observe(100, HOT) is None  # no step past the last


def test_calm_signals_revert_the_last_step_first_and_warm_ones_hold() -> None:
    lad = ladder()
    for now in (0, 10, 20):
        lad.observe(now, HOT)
    assert lad.level == 2
    assert lad.observe(21, WARM) is None  # between thresholds: hold
    assert lad.observe(200, WARM) is None and lad.level == 2
    assert lad.observe(201, CALM) is None
    t = lad.observe(231, CALM)
    assert t is not None and (t.step, t.action, t.level) == (Step.DROP_EXTRAS, "released", 1)
    assert lad.observe(240, CALM) is None
    t = lad.observe(261, CALM)
    assert t is not None and t.step is Step.CAP_MAX_TOKENS and lad.level == 0


def test_a_blip_of_heat_inside_the_calm_dwell_restarts_it() -> None:
    lad = ladder()
    lad.observe(0, HOT)
    lad.observe(10, HOT)
    lad.observe(11, CALM)
    lad.observe(30, HOT)
    assert lad.observe(45, CALM) is None
    assert lad.observe(70, CALM) is None and lad.level == 1  # 25 s calm, not 30
    assert lad.observe(75, CALM) is not None and lad.level == 0


def test_too_few_requests_never_climb() -> None:
    lad = ladder()
    few = SloSignals(ttft_burn=9.0, tpot_burn=9.0, queue_p90_s=9.0, requests=2)
    for now in range(0, 100, 5):
        assert lad.observe(now, few) is None


def test_config_rejects_repeated_steps_and_inverted_hysteresis() -> None:
    with pytest.raises(ValueError, match="once"):
        LadderConfig(steps=(Step.CAP_MAX_TOKENS, Step.CAP_MAX_TOKENS))
    with pytest.raises(ValueError, match="hysteresis"):
        LadderConfig(engage_burn=1.0, release_burn=2.0)


def test_window_burn_rates_and_queue_p90() -> None:
    win = SloWindow(SloTargets(ttft_s=1.0, tpot_s=0.05, percentile=90), window_s=10)
    for i in range(10):
        win.record(i * 0.5, ttft_s=2.0 if i < 3 else 0.2, tpot_s=0.01, queue_s=float(i))
    s = win.signals(5.0)
    assert s.requests == 10
    assert s.ttft_burn == pytest.approx(0.3 / 0.1)
    assert s.tpot_burn == 0.0
    assert s.queue_p90_s == 9.0
    win.record(5.0, ttft_s=None, tpot_s=None)  # refused: late, no TPOT
    assert win.signals(5.0).ttft_burn == pytest.approx(4 / 11 / 0.1)
    assert win.signals(100.0) == SloSignals.calm()  # the window forgets


def _flap(lad: DegradationLadder, engage_at: float) -> float:
    """Hot from ``engage_at`` until the first step engages, then calm until it is released;
    returns the calm the release needed."""
    now = engage_at
    while lad.level == 0:
        lad.observe(now, HOT)
        now += 1
    calm_from = now
    while lad.level == 1:
        lad.observe(now, CALM)
        now += 1
    return now - 1 - calm_from


def test_a_step_needed_again_soon_after_its_release_doubles_its_next_release_dwell() -> None:
    cfg = LadderConfig(steps=STEPS, engage_after_s=10, release_after_s=30,
                       reengage_window_s=60, max_release_after_s=100)  # fmt: skip
    lad = DegradationLadder(cfg)
    dwells = []
    now = 0.0
    for _ in range(4):  # hot again a few seconds after each release: the calm was the step's
        dwells.append(_flap(lad, now))
        now = lad._released_at_s[Step.CAP_MAX_TOKENS] + 5
    assert dwells == [30, 60, 100, 100]  # doubled, up to the cap
    assert lad.release_dwell_s(Step.CAP_MAX_TOKENS) == 100
    # Needed again only after a calm longer than the re-engage window: back to the plain dwell.
    assert _flap(lad, lad._released_at_s[Step.CAP_MAX_TOKENS] + 61) == 30


def test_reengage_window_zero_never_backs_off() -> None:
    cfg = LadderConfig(steps=STEPS, engage_after_s=10, release_after_s=30, reengage_window_s=0)
    lad = DegradationLadder(cfg)
    assert [_flap(lad, 0 if i == 0 else lad._released_at_s[STEPS[0]] + 1) for i in range(3)] == [
        30,
        30,
        30,
    ]


def test_the_back_off_cap_is_never_below_the_plain_release_dwell() -> None:
    cfg = LadderConfig(steps=STEPS, release_after_s=600, max_release_after_s=480)
    assert cfg.release_cap_s == 600
    with pytest.raises(ValueError, match="reengage_window_s"):
        LadderConfig(reengage_window_s=-1)


def test_a_release_waits_until_the_offered_load_falls_or_the_longest_dwell() -> None:
    cfg = LadderConfig(steps=STEPS, engage_after_s=10, release_after_s=30,
                       max_release_after_s=100, release_offered_ratio=0.9)  # fmt: skip
    busy_hot, busy_calm = replace(HOT, offered_per_s=20), replace(CALM, offered_per_s=19)
    eased = replace(CALM, offered_per_s=17)  # under 0.9 x 20
    lad = DegradationLadder(cfg)
    lad.observe(0, busy_hot)
    assert lad.observe(10, busy_hot) is not None
    for now in range(11, 60):  # calm, but asked for as much as when the step was taken
        assert lad.observe(now, busy_calm) is None
    t = lad.observe(60, eased)
    assert t is not None and t.action == "released" and lad.level == 0
    # The load never eases (capacity was added, say): released after the longest dwell.
    lad = DegradationLadder(cfg)
    lad.observe(0, busy_hot)
    lad.observe(10, busy_hot)
    released = [now for now in range(11, 200) if lad.observe(now, busy_calm) is not None]
    assert released == [111]
    # Not asked (ratio 0), or no arrivals recorded: the plain dwell.
    lad = DegradationLadder(replace(cfg, release_offered_ratio=0))
    lad.observe(0, busy_hot)
    lad.observe(10, busy_hot)
    assert [now for now in range(11, 200) if lad.observe(now, busy_calm)] == [41]


def test_window_offered_load_counts_every_arrival() -> None:
    win = SloWindow(SloTargets(ttft_s=1.0, tpot_s=0.05), window_s=10)
    for i in range(30):
        win.record_arrival(i * 0.5)
    assert win.signals(14.5).offered_per_s == pytest.approx(21 / 10)  # 4.5 s to 14.5 s
    assert win.signals(100.0).offered_per_s == 0.0
