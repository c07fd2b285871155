"""Gateway admission decisions (serving/admission.py), table-driven with exact outcomes;
its flags (router/cli.py): parsed, and bad values refused with exit status 2."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.router.cli import main, parse_args
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.admission import (
    REMOVED_ENV,
    AdmissionConfig,
    AdmissionConfigError,
    TenantLoad,
    WorkerQueue,
    decide,
    removed_env_problem,
)
from kvflow.router.settings import ConfigError

KVFLOW = str(Path(sys.executable).with_name("kvflow"))

CONFIG = AdmissionConfig(shed_queue_time_s=10.0, max_queue_time_s=30.0)
ALONE = TenantLoad(num_in_flight=50, weight=1.0, num_in_flight_total=50,
                   active_weight_total=1.0, num_active_tenants=1)  # fmt: skip
# 40 of 50 in flight are this tenant's, one other tenant of equal weight has 10.
HOG = TenantLoad(40, 1.0, 50, 2.0, 2)
SMALL = TenantLoad(10, 1.0, 50, 2.0, 2)
NEW = TenantLoad(0, 1.0, 50, 2.0, 2)


def queue(name: str, waiting: int, rate: float, bound: int = 256) -> WorkerQueue:
    return WorkerQueue(WorkerId(name), waiting, bound, rate)


@pytest.mark.parametrize(
    ("queues", "dispatched", "tenant", "status", "reason", "retry_after_s"),
    [
        ([], 0, HOG, 200, "admitted", 0.0),  # no worker read yet: the pool answers
        ([queue("a", 20, 4.0)], 0, HOG, 200, "admitted", 0.0),  # 5 s: under the shed line
        ([queue("a", 60, 4.0)], 0, HOG, 429, "over_share", 5.0),  # 15 s and over its share
        ([queue("a", 60, 4.0)], 0, SMALL, 200, "admitted", 0.0),  # 15 s, under its share
        ([queue("a", 60, 4.0)], 0, NEW, 200, "admitted", 0.0),
        ([queue("a", 60, 4.0)], 0, ALONE, 200, "admitted", 0.0),  # the only tenant: no share
        ([queue("a", 200, 4.0)], 0, SMALL, 503, "cluster_full", 20.0),  # 50 s for everyone
        ([queue("a", 200, 4.0), queue("b", 8, 4.0)], 0, HOG, 200, "admitted", 0.0),  # b: 2 s
        # This router sent 160 since the last read: 80 more each, b is at 22 s now.
        ([queue("a", 200, 4.0), queue("b", 8, 4.0)], 160, HOG, 429, "over_share", 12.0),
        ([queue("a", 256, 4.0), queue("b", 300, 2.0, 300)], 0, NEW, 503, "queues_full", 1.0),
        ([queue("a", 256, 0.0)], 0, NEW, 503, "queues_full", 1.0),  # full, rate unknown
        ([queue("a", 500, 0.0, bound=0)], 0, HOG, 200, "admitted", 0.0),  # unbounded, unknown
        ([queue("a", 400, 2.0, bound=0)], 0, NEW, 503, "cluster_full", 60.0),  # Retry-After capped
    ],
)
def test_decide(
    queues: list[WorkerQueue],
    dispatched: int,
    tenant: TenantLoad,
    status: int,
    reason: str,
    retry_after_s: float,
) -> None:
    verdict = decide(queues, dispatched, tenant, CONFIG)
    assert (verdict.status, verdict.reason) == (status, reason)
    assert verdict.retry_after_s == pytest.approx(retry_after_s)


def test_priority_weights_the_share() -> None:
    # 30 of 50 in flight: over an equal share, within a share twice the other's.
    assert TenantLoad(30, 1.0, 50, 2.0, 2).is_over_share()
    assert not TenantLoad(30, 2.0, 50, 3.0, 2).is_over_share()


def test_disabled_admits_everything() -> None:
    off = AdmissionConfig(is_enabled=False)
    assert decide([queue("a", 256, 1.0)], 0, NEW, off).is_admitted


def test_flags_set_the_config_and_defaults_hold_without_them() -> None:
    settings = parse_args(["--admission-shed-queue-time-s", "2", "--admission-max-queue-time-s",
                           "4.5", "--admission-poll-interval-s", "0.1"], env={})  # fmt: skip
    assert settings is not None
    assert settings.admission == AdmissionConfig(2.0, 4.5, 0.1, is_enabled=True)
    off = parse_args(["--admission", "off"], env={})
    assert off is not None and not off.admission.is_enabled
    defaults = parse_args([], env={})
    assert defaults is not None and defaults.admission == AdmissionConfig()
    assert (defaults.admission.shed_queue_time_s, defaults.admission.max_queue_time_s) == (10, 30)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--admission-shed-queue-time-s", "60"],
         "--admission-shed-queue-time-s (60) must be at most --admission-max-queue-time-s (30)"),
        (["--admission-max-queue-time-s", "5"],
         "--admission-shed-queue-time-s (10) must be at most --admission-max-queue-time-s (5)"),
        (["--admission-max-queue-time-s", "soon"],
         "--admission-max-queue-time-s: must be a number of seconds > 0, got 'soon'"),
        (["--admission-poll-interval-s", "0"],
         "--admission-poll-interval-s: must be a number of seconds > 0, got '0'"),
        (["--admission-shed-queue-time-s", "inf"], "got 'inf'"),
        (["--admission", "maybe"], "--admission: invalid choice: 'maybe'"),
    ],
)  # fmt: skip
def test_bad_flags_exit_2_saying_what_to_change(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in REMOVED_ENV:
        monkeypatch.delenv(name, raising=False)
    try:
        # A model that does not exist: were the flags accepted, the router would stop there
        # (exit 2 with another message) instead of serving.
        code = main([*args, "--model", "/nonexistent/model"])
    except SystemExit as exited:  # argparse's own refusals
        code = exited.code
    assert code == 2
    assert says in capsys.readouterr().err


def test_the_removed_environment_variables_stop_the_router_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ConfigError, match=r"KVFLOW_ADMISSION_MAX_QUEUE_TIME_S is no longer read"
                       r".*pass --admission-max-queue-time-s instead"):  # fmt: skip
        parse_args([], env={"KVFLOW_ADMISSION_MAX_QUEUE_TIME_S": "5"})
    # The real entry point, in a real process: exit 2 before loading anything.
    env = {**os.environ, "KVFLOW_ADMISSION": "off"}
    done = subprocess.run([KVFLOW, "router", "--workers", "127.0.0.1:1"], check=False,
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "KVFLOW_ADMISSION is no longer read" in done.stderr
    assert "pass --admission on|off instead" in done.stderr


def test_config_errors_name_the_flags() -> None:
    with pytest.raises(AdmissionConfigError, match="--admission-poll-interval-s must be"):
        AdmissionConfig(poll_interval_s=math.nan)
    assert removed_env_problem({"PATH": "/bin"}) is None
