"""The planner reacting to measured latency, queue wait, KV usage and pods (pure)."""

from __future__ import annotations

from planner.history import TPOT_S, TTFT_S, Run, calm, config, with_ready


def test_ttft_burst_scales_prefill_up_at_once_capped_at_double() -> None:
    run = Run(config("prefill"))
    assert not run.step("prefill", calm(0, 2)).is_change
    # TTFT at 1.5x target: 2 replicas -> ceil(2 x 1.5) = 3.
    d = run.step("prefill", calm(30, 2, ttft_s=1.5 * TTFT_S, ttft_violation_fraction=0.4))
    assert (d.replicas, d.reason) == (3, "TtftViolation")
    # 10x target is "more", not 10x: at most double (3 -> 6), once the cooldown is over.
    d = run.step("prefill", calm(100, 3, ttft_s=10 * TTFT_S))
    assert (d.replicas, d.reason) == (6, "TtftViolation")


def test_violation_fraction_alone_scales_up() -> None:
    # p90 unmeasured but 30 % of requests over target (budget 10 %): 3x -> capped at 2x.
    d = Run(config("prefill")).step("prefill", calm(0, 2, ttft_s=None, ttft_violation_fraction=0.3))
    assert (d.replicas, d.reason) == (4, "TtftViolation")
    assert "ttft_s" in d.message  # and it says the p90 was missing


def test_tpot_and_kv_scale_decode() -> None:
    d = Run(config("decode")).step("decode", calm(0, 4, tpot_s=1.3 * TPOT_S))
    assert (d.replicas, d.reason) == (6, "TpotViolation")  # ceil(4 x 1.3)
    d = Run(config("decode")).step("decode", calm(0, 4, kv_usage=0.95))
    assert (d.replicas, d.reason) == (5, "KvPressure")  # ceil(4 x 0.95 / 0.8)


def test_queue_wait_scales_prefill() -> None:
    # Wait limit 0.5 s (half the TTFT target); 0.6 s of wait with TTFT still under target.
    d = Run(config("prefill")).step(
        "prefill", calm(0, 2, prefill_queue_wait_s=0.6, ttft_s=0.8 * TTFT_S)
    )
    assert (d.replicas, d.reason) == (3, "QueueWait")
    # With TTFT low, a long mean wait is a drained backlog's tail: no scale-up on it.
    d = Run(config("prefill")).step(
        "prefill", calm(0, 2, prefill_queue_wait_s=2.0, ttft_s=0.1 * TTFT_S)
    )
    assert (d.replicas, d.reason) == (2, "Steady")
    assert "queue wait 2 s" in d.message


def test_colocated_reads_both_sides() -> None:
    d = Run(config("colocated")).step("colocated", calm(0, 2, tpot_s=1.6 * TPOT_S))
    assert (d.replicas, d.reason) == (4, "TpotViolation")
    d = Run(config("colocated")).step(
        "colocated", calm(0, 2, prefill_queue_wait_s=0.9, ttft_s=None, ttft_violation_fraction=None)
    )
    assert d.reason == "QueueWait"


def test_cooldown_holds_a_second_latency_scale_up() -> None:
    run = Run(config("prefill", scale_up_cooldown_s=60))
    hot = {"ttft_s": 2 * TTFT_S}
    assert run.step("prefill", calm(0, 2, **hot)).replicas == 4
    d = run.step("prefill", calm(30, 4, **hot))  # new replicas ready, latency not yet down
    assert (d.replicas, d.reason) == (4, "Cooldown")
    assert "30 s ago" in d.message
    d = run.step("prefill", calm(60, 4, **hot))  # cooldown over
    assert (d.replicas, d.reason) == (8, "TtftViolation")


def test_starting_replicas_hold_latency_scale_ups_past_the_cooldown() -> None:
    # Start-up 120 s, cooldown 60 s: at 90 s two added replicas still start; adding more on
    # a latency that has not seen them would overshoot.
    run = Run(config("prefill", scale_up_cooldown_s=60, replica_startup_s=120))
    hot = {"ttft_s": 2 * TTFT_S}
    assert run.step("prefill", calm(0, 2, **hot)).replicas == 4
    d = run.step("prefill", with_ready(calm(90, 4, **hot), ready=3))
    assert (d.replicas, d.reason) == (4, "Cooldown")
    assert "1 replica(s) still starting" in d.message
    # ...but only for twice the start-up time: a pod that never turns ready frees the role.
    d = run.step("prefill", with_ready(calm(240, 4, **hot), ready=3))
    assert (d.replicas, d.reason) == (6, "TtftViolation")  # from the 3 ready: ceil(3 x 2)


def test_pending_pods_stop_a_runaway_scale_up() -> None:
    run = Run(config("decode", max_replicas=64))
    hot = {"tpot_s": 3 * TPOT_S, "kv_usage": 0.97}
    assert run.step("decode", calm(0, 2, **hot)).replicas == 4
    # One of the four never schedules (no free GPUs); the latency stays bad for 20 minutes
    # and the three ready ones would ask for 6.
    for i in range(1, 40):
        d = run.step("decode", with_ready(calm(30 * i, 4, **hot), ready=3, unschedulable=1))
        assert (d.replicas, d.reason) == (4, "PendingPods"), i
    assert "Pending for lack of resources" in d.message
    # Once they schedule, scaling resumes.
    d = run.step("decode", calm(30 * 40, 4, **hot))
    assert (d.replicas, d.reason) == (8, "TpotViolation")


def test_pending_pods_do_not_block_a_scale_down() -> None:
    run = Run(config("prefill"))
    for i in range(12):
        d = run.step("prefill", with_ready(calm(30 * i, 4), ready=3, unschedulable=1))
    assert (d.replicas, d.reason) == (3, "Underloaded")


def test_scale_down_waits_a_whole_window_and_steps_once_per_window() -> None:
    run = Run(config("prefill", scale_down_stabilization_s=300))
    replicas = 4
    changes = []
    for i in range(25):  # 12 minutes of calm
        d = run.step("prefill", calm(30 * i, replicas))
        if d.is_change:
            changes.append((30 * i, d.replicas))
        elif i * 30 < 300:
            assert d.reason == "Stabilizing"
        replicas = d.replicas
    # One step per 300 s window without a capacity profile; first after a full window.
    assert changes == [(300, 3), (630, 2)]


def test_one_hot_interval_resets_the_scale_down_window() -> None:
    run = Run(config("prefill", scale_down_stabilization_s=300))
    for i in range(9):
        run.step("prefill", calm(30 * i, 4))
    run.step("prefill", calm(270, 4, ttft_s=0.7 * TTFT_S))  # not calm: over 60 % of target
    for i in range(10, 19):
        d = run.step("prefill", calm(30 * i, 4))
        assert not d.is_change, i
    assert d.reason == "Stabilizing"


def test_hysteresis_band_holds() -> None:
    # TTFT at 80 % of target: no violation, not calm: nothing moves, ever.
    run = Run(config("prefill"))
    for i in range(30):
        d = run.step("prefill", calm(30 * i, 3, ttft_s=0.8 * TTFT_S))
        assert (d.replicas, d.reason) == (3, "Steady")
    assert "TTFT" in d.message


def test_idle_role_goes_to_min_after_a_window() -> None:
    run = Run(config("decode", min_replicas=1))
    idle = {
        "request_rate_per_s": 0.0,
        "ttft_s": None,
        "tpot_s": None,
        "kv_usage": 0.0,
        "decode_batch_size": 0.0,
        "mean_input_tokens": None,
        "mean_output_tokens": None,
    }
    decisions = [run.step("decode", calm(30 * i, 5, **idle)) for i in range(12)]
    assert [d.replicas for d in decisions[:10]] == [5] * 10
    assert (decisions[10].replicas, decisions[10].reason) == (1, "Underloaded")
