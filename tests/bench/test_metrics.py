"""The harness's numbers on a tiny set of timed responses, checked by hand (see each comment)."""

from __future__ import annotations

import math

import pytest

from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo, percentile
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits, knee, summarize

SLO = Slo(ttft_s=0.3, tpot_s=0.08)
POINT = LoadPoint(ArrivalKind.POISSON, 1.0)


def ok(sent_s: float, tokens_s: tuple[float, ...], num_output: int, end_s: float,
       prompt: int | None = None, cached: int | None = None,
       scheduled_s: float | None = None) -> RequestRecord:  # fmt: skip
    return RequestRecord(
        request_id=f"r{sent_s}",
        scheduled_s=sent_s if scheduled_s is None else scheduled_s,
        sent_s=sent_s,
        end_s=end_s,
        token_times_s=tokens_s,
        num_output_tokens=num_output,
        num_prompt_tokens=prompt,
        num_cached_tokens=cached,
    )


WARMUP = ok(0.5, (0.6, 0.7), 2, 0.7, 10, 10)  # scheduled before warmup_s=1: not measured
A = ok(1.0, (1.1, 1.15, 1.25, 1.3), 4, 1.31, 100, 50)  # TTFT .1, TPOT .2/3, ITL .05 .1 .05
B = ok(2.0, (2.5, 2.9), 5, 2.95, 100, 0)  # usage says 5 tokens in 2 chunks: TPOT .4/4 = .1
C = RequestRecord("c", 3.0, 3.0, 3.2, error="http_503", error_detail="HTTP 503: no worker")
D = ok(4.0, (4.2,), 1, 4.25, 50, None)  # one token: no TPOT; no cached count reported


def test_percentile_interpolates_linearly() -> None:
    assert percentile([1.0], 0.9) == 1.0
    assert percentile([0.1, 0.2, 0.5], 0.5) == 0.2
    assert percentile([0.1, 0.2, 0.5], 0.9) == pytest.approx(0.44)  # 0.2 + 0.8 * 0.3
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_hand_checked_load_point() -> None:
    s = summarize(POINT, [WARMUP, A, B, C, D], warmup_s=1.0, offered_rate_per_s=1.0, slo=SLO)
    assert s.num_warmup == 1
    lat = s.latency
    # TTFTs .1 .5 .2 (C failed): P50 .2, P90 .2 + .8 * .3
    assert (lat.ttft_s.count, lat.ttft_s.p50) == (3, pytest.approx(0.2))
    assert lat.ttft_s.p90 == pytest.approx(0.44)
    assert lat.ttft_s.p99 == pytest.approx(0.494)
    assert lat.ttft_s.mean == pytest.approx(0.8 / 3)
    # TPOT (T_last - T_first) / (O - 1): A .2/3, B .4/4; D has one token and no TPOT.
    assert lat.tpot_s.count == 2
    assert lat.tpot_s.p50 == pytest.approx((0.2 / 3 + 0.1) / 2)
    # ITL pooled over chunks: .05 .05 .1 .4
    assert lat.itl_s.count == 4
    assert lat.itl_s.p50 == pytest.approx(0.075)
    assert lat.itl_s.p90 == pytest.approx(0.31)  # .1 + .7 * .3
    assert lat.e2e_s.p50 == pytest.approx(0.31)  # of .31 .95 .25
    # With C as an infinite TTFT, the P90 of .1 .2 .5 inf is infinite.
    assert lat.ttft_p90_with_failures_s is None
    assert not s.meets_ttft_slo

    t = s.throughput
    window_s = 4.25 - 1.0  # first measured send to last measured end
    assert t.window_s == pytest.approx(window_s)
    assert (t.num_measured, t.num_ok) == (4, 3)
    assert t.requests_per_s == pytest.approx(3 / window_s)
    assert t.output_tokens_per_s == pytest.approx((4 + 5 + 1) / window_s)
    # A meets both SLOs; B misses TTFT (.5 > .3); C failed; D meets TTFT and has no TPOT.
    assert t.goodput_per_s == pytest.approx(2 / window_s)
    assert t.slo_attainment == pytest.approx(0.5)
    assert t.errors == {"http_503": 1}
    assert t.error_examples == {"http_503": "HTTP 503: no worker"}
    assert t.mean_output_tokens == pytest.approx(10 / 3)
    assert t.mean_prompt_tokens == pytest.approx(250 / 3)
    # Cached over prompt tokens where reported (A and B): 50 / 200.
    assert s.cache.hit_rate == pytest.approx(0.25)
    assert s.cache.num_reporting == 2
    assert s.schedule.is_valid
    assert s.schedule.achieved_rate_per_s == pytest.approx(1.0)  # 3 gaps over 3 s


def test_tpot_is_strict_about_its_slo() -> None:
    # TTFT fine, TPOT .1 > .08: not good; at .1 exactly it is.
    slow = ok(0.0, (0.1, 0.5), 5, 0.5)
    s = summarize(POINT, [slow], warmup_s=0.0, offered_rate_per_s=1.0, slo=SLO)
    assert s.throughput.goodput_per_s == 0.0
    s = summarize(POINT, [slow], warmup_s=0.0, offered_rate_per_s=1.0, slo=Slo(0.3, 0.1))
    assert s.throughput.goodput_per_s == pytest.approx(1 / 0.5)


def test_a_lagging_schedule_is_invalid() -> None:
    # Sent 30 ms after their scheduled times: beyond the 20 ms limit.
    late = [ok(t + 0.03, (t + 0.1,), 1, t + 0.1, scheduled_s=t) for t in (0.0, 1.0, 2.0)]
    s = summarize(POINT, late, warmup_s=0.0, offered_rate_per_s=1.0, slo=SLO)
    assert not s.schedule.is_valid
    assert "lagged the schedule by 30.0 ms" in s.schedule.problems[0]
    assert s.schedule.lag_s.p99 == pytest.approx(0.03)
    assert not s.meets_ttft_slo  # fast, but not at the load it claims
    ok_limits = ScheduleLimits(max_lag_s=0.05)
    s = summarize(POINT, late, warmup_s=0.0, offered_rate_per_s=1.0, slo=SLO, limits=ok_limits)
    assert s.schedule.is_valid and s.meets_ttft_slo


def test_falling_behind_the_schedule_rate_is_invalid() -> None:
    # Scheduled 1 s apart, sent 1.5 s apart (lag within the limit is not enough).
    behind = [ok(1.5 * i, (1.5 * i + 0.1,), 1, 1.5 * i + 0.1, scheduled_s=1.0 * i)
              for i in range(3)]  # fmt: skip
    limits = ScheduleLimits(max_lag_s=10.0)
    s = summarize(POINT, behind, warmup_s=0.0, offered_rate_per_s=1.0, slo=SLO, limits=limits)
    assert not s.schedule.is_valid
    assert s.schedule.achieved_rate_per_s == pytest.approx(2 / 3)


def point(rate: float, ttft_s: float, lag_s: float = 0.0) -> LoadPointSummary:
    records = [ok(t + lag_s, (t + lag_s + ttft_s,), 1, t + lag_s + ttft_s, scheduled_s=t)
               for t in (0.0, 0.5, 1.0)]  # fmt: skip
    return summarize(LoadPoint(ArrivalKind.POISSON, rate), records, warmup_s=0.0,
                     offered_rate_per_s=rate, slo=SLO)  # fmt: skip


def test_knee_is_the_highest_valid_rate_meeting_the_ttft_slo() -> None:
    points = [point(1, 0.1), point(2, 0.25), point(4, 0.5), point(8, 0.1, lag_s=0.1)]
    best = knee(points)
    assert best is not None and best.qps == 2  # 4 misses; 8 is fast but lagged (invalid)
    assert knee([point(1, 0.4)]) is None
    assert knee([]) is None


def test_closed_loop_has_no_schedule_and_uses_achieved_rate() -> None:
    records = [ok(t, (t + 0.1,), 1, t + 0.1, scheduled_s=None) for t in (0.0, 0.25, 0.5)]
    records = [RequestRecord(r.request_id, None, r.sent_s, r.end_s, r.token_times_s, 1)
               for r in records]  # fmt: skip
    s = summarize(LoadPoint(ArrivalKind.CLOSED, 2), records, warmup_s=0.0,
                  offered_rate_per_s=None, slo=SLO)  # fmt: skip
    assert s.schedule.is_valid and s.schedule.lag_s.count == 0
    assert s.qps == pytest.approx(4.0)  # 2 gaps in 0.5 s
    assert s.meets_ttft_slo and knee([s]) is s
    assert math.isclose(s.latency.ttft_s.p50 or 0, 0.1)


def closed(sent_s: float, end_s: float, num_output: int = 10) -> RequestRecord:
    return RequestRecord(f"u{sent_s}", None, sent_s, end_s, (sent_s + 0.1,), num_output)


def test_closed_loop_rates_count_completions_inside_the_window() -> None:
    # Window [10, 20): one user's requests take 4 s each, another's 30 s (a server that
    # serves one at a time). Completions inside it: the ones ending at 12, 16 and 20.
    records = [closed(8, 12), closed(12, 16), closed(16, 20), closed(20, 24),
               closed(9, 39), closed(39, 69)]  # fmt: skip
    s = summarize(LoadPoint(ArrivalKind.CLOSED, 2), records, warmup_s=10.0,
                  offered_rate_per_s=None, slo=Slo(ttft_s=1.0, tpot_s=1.0),
                  closed_window_s=(10.0, 20.0))  # fmt: skip
    assert s.throughput.window_s == 10.0
    assert s.throughput.requests_per_s == pytest.approx(0.3)  # 3 completions / 10 s
    assert s.throughput.output_tokens_per_s == pytest.approx(3.0)
    assert s.throughput.goodput_per_s == pytest.approx(0.3)
    # Latency and counts still describe the requests sent inside the window.
    assert s.throughput.num_measured == 4 and s.num_warmup == 2
    # Over the span from the window's first send to its last end (what it was before),
    # the same run read 4 requests / 57 s: under a quarter of the rate the server kept up.
    span = summarize(LoadPoint(ArrivalKind.CLOSED, 2), records, warmup_s=10.0,
                     offered_rate_per_s=None, slo=Slo(ttft_s=1.0, tpot_s=1.0))  # fmt: skip
    assert span.throughput.requests_per_s == pytest.approx(4 / 57)
