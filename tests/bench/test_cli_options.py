"""`kvflow bench` refuses options that do not fit together, with what to change (exit 2)."""

from __future__ import annotations

import io

import pytest

from kvflow.cli.bench import base_url, main, refuses_ignore_eos
from kvflow.cli.main import main as kvflow_main
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.summary import summarize

URL = ["--url", "http://127.0.0.1:9", "--model", "m"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--rates", "1", "--users", "2"],
            "give one of --rates, --speedups, --users, not rates, users",
        ),
        (["--speedups", "2"], "--speedups replays a trace's clock: it needs --workload trace"),
        (["--workload", "trace"], "--workload trace needs --trace PATH"),
        (["--trace", "x.jsonl"], "--trace is for --workload trace"),
        (["--turns", "0"], "--turns must be at least 1"),
        (["--duration-s", "0"], "--duration-s must be > 0"),
        (["--input-scale", "0"], "--input-scale and --output-scale must be > 0"),
    ],
)
def test_bad_options_exit_2_with_the_reason(args: list[str], message: str) -> None:
    err = io.StringIO()
    assert main([*URL, *args], out=io.StringIO(), err=err) == 2
    assert message in err.getvalue()


@pytest.mark.parametrize("args", [["--rates", "0,5"], ["--users", "1.5"], ["--prefix-words", "x"]])
def test_unparseable_lists_are_argparse_errors(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([*URL, *args], out=io.StringIO(), err=io.StringIO())
    assert info.value.code == 2
    assert "expected" in capsys.readouterr().err


def test_base_url_accepts_host_or_v1() -> None:
    assert base_url("http://h:8000") == "http://h:8000/v1"
    assert base_url("http://h:8000/") == "http://h:8000/v1"
    assert base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert base_url("https://api.example.com/openai/v1") == "https://api.example.com/openai/v1"


def test_kvflow_lists_bench(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvflow_main([]) == 0
    assert "bench" in capsys.readouterr().out


def test_a_server_refusing_ignore_eos_is_named() -> None:
    detail = "HTTP 400: Unrecognized request argument: ignore_eos"
    refused = RequestRecord("r", 0.0, 0.0, 0.01, error="http_400", error_detail=detail)
    other = RequestRecord("r", 0.0, 0.0, 0.01, error="http_400", error_detail="HTTP 400: bad")
    slo = Slo(1.0, 0.1)
    point = LoadPoint(ArrivalKind.POISSON, 1.0)
    summary = summarize(point, [refused], warmup_s=0, offered_rate_per_s=1.0, slo=slo)
    assert refuses_ignore_eos([summary])
    summary = summarize(point, [other], warmup_s=0, offered_rate_per_s=1.0, slo=slo)
    assert not refuses_ignore_eos([summary])
