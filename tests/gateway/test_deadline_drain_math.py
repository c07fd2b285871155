"""The pure parts of stream deadlines and the router's drain: exact
times in, exact answers out (the real-process tests are test_stream_deadlines.py and
test_router_drain.py)."""

from __future__ import annotations

import pytest

from kvflow.router.api.drain import DrainState
from kvflow.router.cli import parse_args
from kvflow.router.workers.deadlines import DeadlineKind, StreamClock, StreamDeadlines


def test_first_token_deadline_from_the_start_then_the_stall_from_each_token() -> None:
    clock = StreamClock(StreamDeadlines(first_token_s=60, stall_s=30), started_s=100.0)
    assert clock.expires_at_s() == 160.0
    assert clock.miss(159.9) is None
    miss = clock.miss(160.0)
    assert miss is not None and miss.kind is DeadlineKind.FIRST_TOKEN
    assert (miss.waited_s, miss.limit_s) == (60.0, 60)
    assert "--first-token-timeout-s" in miss.describe()

    clock.saw_token(150.0)  # in time: from now on the stall deadline, from this token
    assert clock.has_token and clock.expires_at_s() == 180.0
    assert clock.miss(175.0) is None
    clock.saw_token(175.0)
    assert clock.expires_at_s() == 205.0
    assert clock.miss(204.9) is None
    miss = clock.miss(206.0)
    assert miss is not None and miss.kind is DeadlineKind.STALL
    assert (miss.waited_s, miss.limit_s) == (31.0, 30)
    assert "31.0 s" in miss.describe() and "--token-stall-timeout-s" in miss.describe()


def test_drain_waits_for_running_requests_up_to_the_grace() -> None:
    drain = DrainState(grace_s=25)
    drain.num_in_flight = 2
    assert not drain.is_draining and not drain.is_done(0.0)
    assert drain.begin(10.0) and drain.is_draining
    assert not drain.begin(12.0)  # a second signal does not restart the grace
    assert not drain.is_done(34.9)
    assert drain.is_done(35.0)  # the grace is over, requests or not
    drain.num_in_flight = 0
    assert drain.is_done(11.0)  # nothing left to wait for: done at once


def test_an_idle_router_is_done_draining_at_once_and_zero_grace_waits_for_nothing() -> None:
    drain = DrainState(grace_s=0)
    drain.num_in_flight = 5
    drain.begin(1.0)
    assert drain.is_done(1.0)


def test_flags_set_the_deadlines_and_the_grace() -> None:
    settings = parse_args(["--first-token-timeout-s", "5", "--token-stall-timeout-s", "2.5",
                           "--drain-grace-s", "0"])  # fmt: skip
    assert settings is not None
    assert settings.deadlines == StreamDeadlines(first_token_s=5.0, stall_s=2.5)
    assert settings.drain_grace_s == 0.0
    defaults = parse_args([])
    assert defaults is not None
    assert defaults.deadlines == StreamDeadlines(60.0, 30.0) and defaults.drain_grace_s == 25.0


@pytest.mark.parametrize(
    "args",
    [["--first-token-timeout-s", "0"], ["--token-stall-timeout-s", "-1"],
     ["--token-stall-timeout-s", "nan"], ["--drain-grace-s", "soon"],
     ["--drain-grace-s", "inf"]],
)  # fmt: skip
def test_bad_durations_are_refused_with_the_flag_named(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(args)
    assert exited.value.code == 2
    assert args[0] in capsys.readouterr().err
