"""A queue that built up: sized to drain by the time new replicas serve, then let go (pure).

One replica holds 10 k prompt tokens/s: 10 requests/s of the helpers' 1 k-token prompts,
so 30 requests/s are 3 shares and want 4 replicas at 80 %.
"""

from __future__ import annotations

from dataclasses import replace

from planner.history import TTFT_S, Run, calm, config, with_ready

from kvflow.operator.planner import CapacityProfile

CAP = CapacityProfile(max_prompt_tokens_per_s=10_000, max_decode_tokens_per_s=1_000, source="test")
HOT = {"request_rate_per_s": 30.0}


def test_a_backlog_is_sized_for_the_queue_when_new_replicas_serve() -> None:
    # 2 replicas serve 20 of 30 requests/s with 600 queued. A replica ordered now serves in
    # 60 s, by when 600 more have queued: 1,200 to drain within 60 s is 20 requests/s more,
    # 5 shares, 7 replicas at 80 %.
    obs = calm(0, 2, num_waiting_requests=600.0, **HOT)
    d = Run(config("prefill", capacity=CAP, max_replicas=20)).step("prefill", obs)
    assert (d.replicas, d.reason) == (7, "Backlog")
    assert "600 requests queued (1200 when a new replica serves): 7 drain them" in d.message
    # Replicas that serve at once find 600: 4 shares, 5 replicas.
    run = Run(config("prefill", capacity=CAP, max_replicas=20, replica_startup_s=0))
    assert (run.step("prefill", obs).replicas, run.step("prefill", obs).reason) == (5, "Backlog")
    # Without the queue length: the load alone.
    d = Run(config("prefill", capacity=CAP)).step("prefill", calm(0, 2, **HOT))
    assert (d.replicas, d.reason) == (4, "ForecastLoad")


def test_a_queue_the_gateway_bounds_does_not_grow_while_replicas_start() -> None:
    # As above, but the gateway refuses what its queues cannot take in time (a third of the
    # window's requests): the excess is refused, not queued, so only the 600 there drain
    # (1 share): 5 replicas, not the 7 a queue growing for the whole start-up would buy.
    obs = calm(0, 2, num_waiting_requests=600.0, shed_fraction=0.33, **HOT)
    d = Run(config("prefill", capacity=CAP, max_replicas=20)).step("prefill", obs)
    assert (d.replicas, d.reason) == (5, "Backlog")
    assert "600 requests queued (600 when a new replica serves)" in d.message


def test_a_short_queue_is_a_batch_forming_not_a_backlog() -> None:
    # 6 replicas at 10 requests/s drain 20 queued within a tenth of a second: it neither
    # buys replicas nor blocks the scale-down to 2 (10 k tokens/s at 60 %).
    run = Run(config("prefill", capacity=CAP))
    for i in range(12):
        d = run.step("prefill", calm(30 * i, 6, num_waiting_requests=20.0))
    assert (d.replicas, d.reason) == (2, "Underloaded")


def test_replicas_still_starting_drain_the_queue_from_when_they_serve() -> None:
    run = Run(config("prefill", capacity=CAP, max_replicas=20))
    assert run.step("prefill", calm(0, 2, num_waiting_requests=600.0, **HOT)).replicas == 7
    # 30 s later 1,200 are queued; the 5 starting serve in 30 s, after 300 more: 1,500 to
    # drain is 2.5 shares, 7 replicas: nothing more. (Counting the ready ones alone for a
    # whole start-up would queue 1,800 and buy an 8th.)
    starting = with_ready(calm(30, 7, num_waiting_requests=1200.0, **HOT), ready=2)
    d = run.step("prefill", starting)
    assert (d.replicas, d.reason) == (7, "Steady")
    assert "1200 requests queued" in d.message
    # After an operator restart nobody knows when they serve: a whole start-up, 8.
    d = Run(config("prefill", capacity=CAP, max_replicas=20)).step("prefill", starting)
    assert (d.replicas, d.reason) == (8, "Backlog")


def test_a_queue_blocks_a_scale_down() -> None:
    run = Run(config("prefill", capacity=CAP))
    for i in range(20):  # 10 requests/s on 6 replicas: 2 would do, but 100 wait
        d = run.step("prefill", calm(30 * i, 6, num_waiting_requests=100.0))
        assert d.replicas == 6
    assert "100 requests queued" in d.message


def _settled(run: Run, replicas: int) -> None:
    """A full stabilization window at 30 requests/s on `replicas`, the queue empty."""
    for i in range(11):
        run.step("prefill", calm(30 * i, replicas, num_waiting_requests=0.0, **HOT))


def test_the_replicas_of_a_drained_backlog_go_without_a_window() -> None:
    run = Run(config("prefill", capacity=CAP, max_replicas=20, replica_startup_s=0))
    _settled(run, 4)
    d = run.step("prefill", calm(330, 4, num_waiting_requests=1200.0, **HOT))
    assert (d.replicas, d.reason) == (7, "Backlog")  # 3 + 2 shares at 80 %
    # Drained: 7 run under the scale-down's 60 % (3 shares need 5 for that), so the pool
    # lands mid-band, 5 at 70 %; and what the stabilization window remembers of the
    # backlog is the 4 its load needed, not the 7 of its drain.
    d = run.step("prefill", calm(360, 7, num_waiting_requests=0.0, **HOT))
    assert (d.replicas, d.reason) == (5, "Underloaded")


def test_latency_from_a_drained_queue_buys_nothing_and_is_not_remembered() -> None:
    run = Run(config("prefill", capacity=CAP, max_replicas=20, replica_startup_s=0))
    _settled(run, 4)
    run.step("prefill", calm(330, 4, num_waiting_requests=1200.0, **HOT))
    # The queue is empty now, but the window's TTFT still holds the drained requests: no
    # replica for it (the profile says 7 carry the load)...
    tail = calm(360, 7, num_waiting_requests=0.0, ttft_s=5 * TTFT_S, **HOT)
    d = run.step("prefill", replace(tail, ttft_violation_fraction=0.3))
    assert (d.replicas, d.reason) == (7, "BacklogDraining")
    assert "no queue now" in d.message
    # ...and once calm the pool goes to what the load needs, not held for a window at 7.
    d = run.step("prefill", calm(390, 7, num_waiting_requests=0.0, **HOT))
    assert (d.replicas, d.reason) == (5, "Underloaded")


def test_latency_over_a_queue_the_replicas_drain_in_time_buys_nothing() -> None:
    # 7 replicas, 30 requests/s, 200 still queued (on the replicas that had them when the
    # new ones came): 5 drain it within 60 s, so TTFT over target is its tail. No replica
    # (one could not take the queued requests anyway).
    obs = calm(0, 7, num_waiting_requests=200.0, ttft_s=5 * TTFT_S, **HOT)
    d = Run(config("prefill", capacity=CAP)).step(
        "prefill", replace(obs, ttft_violation_fraction=0.3)
    )
    assert (d.replicas, d.reason) == (7, "BacklogDraining")
    assert "the queue drains within 60 s" in d.message
