"""Every command refuses a port outside 0-65535, and the worker a size, count or time out of
its range, when it parses its flags: a usage error naming the flag (the installed `kvflow`
in a subprocess). gRPC bound such a port modulo 65536 (a worker asked for 99999 listened on
34463), the gateway's socket raised a traceback, and the worker's numbers failed later
(--block-size 0 divided by zero) or not at all (--drain-timeout-s -5)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVFLOW = Path(sys.executable).parent / "kvflow"  # the console script `pip install` made


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("up", "--port", "99999"),
        ("router", "--port", "-1"),
        ("router", "--metrics-port", "65536"),
        ("worker", "--port", "99999"),
        ("worker", "--metrics-port", "-5"),
        ("worker", "--kv-port", "70000"),
        ("operator", "--liveness-port", "1e3"),
    ],
)
def test_a_port_out_of_range_is_a_usage_error(command: str, flag: str, value: str) -> None:
    done = subprocess.run([str(KVFLOW), command, flag, value], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}: " in done.stderr and "is not a port" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--block-size", "0", "integer >= 1"),  # divided by zero
        ("--max-model-len", "0", "integer >= 1"),
        ("--num-kv-blocks", "-4", "integer >= 1"),
        ("--kv-cache-gib", "inf", "number of GiB > 0"),  # "cannot convert float NaN to integer"
        ("--decode-workspace-gib", "-1", "number of GiB >= 0"),
        ("--engine-stall-timeout-s", "0", "number of seconds > 0"),  # an AssertionError
        ("--drain-timeout-s", "-5", "number of seconds >= 0"),  # served as if 0
        ("--max-kv-transfer-timeout-s", "nan", "number of seconds > 0"),
        ("--sim-per-token-ms", "-0.1", "number of ms >= 0"),
    ],
)
def test_a_worker_number_out_of_range_is_a_usage_error(flag: str, value: str, says: str) -> None:
    done = subprocess.run([str(KVFLOW), "worker", "--simulate", flag, value],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"argument {flag}: " in done.stderr and says in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--kv-cache-gib", "-1", "number of GiB > 0"),  # the worker's whole usage text
        ("--startup-timeout-s", "0", "number of seconds > 0"),  # a traceback
        ("--tensor-parallel-size", "0", "integer >= 1"),
    ],
)
def test_an_up_number_out_of_range_is_its_own_usage_error(flag: str, value: str, says: str) -> None:
    done = subprocess.run([str(KVFLOW), "up", "--simulate", flag, value],
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: kvflow up") and says in done.stderr
