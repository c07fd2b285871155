"""Every listening command refuses a port outside 0-65535 when it parses its flags, with a
usage error naming the flag (the installed `kvflow` in a subprocess). gRPC bound such a
number modulo 65536 (a worker asked for 99999 listened on 34463) and the gateway's socket
raised a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.proto.ports import port_number

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


def test_ports_from_any_free_one_to_the_last() -> None:
    assert [port_number(p) for p in ("0", "1", "8000", "65535")] == [0, 1, 8000, 65535]
    for bad in ("65536", "-1", "80.5", "http", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="from 0 \\(any free port\\)"):
            port_number(bad)
