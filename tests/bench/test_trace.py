"""Mooncake-format trace parsing: the real trace loads; each malformed line is an error
naming the file, the line number and the field."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvflow.loadgen.trace import MOONCAKE_TRACE, TraceError, TraceRecord, load_trace, parse_trace

# The Mooncake trace ships in the repository (traces/, Apache-2.0 with its licence).
TRACES = Path(os.environ.get("KVFLOW_TRACES_DIR", Path(__file__).parents[2] / "traces"))
MOONCAKE = TRACES / "mooncake-fast25/synthetic_trace.jsonl"
GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}


def line(**changes: object) -> str:
    obj = {**GOOD, **changes}
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


def test_parses_records_and_skips_blank_lines() -> None:
    lines = [line(), "", line(timestamp=40.5, hash_ids=[0, 2], extra="ignored") + "\n"]
    assert parse_trace(lines, "t.jsonl") == [
        TraceRecord(0.0, 1000, 5, (0, 1)),
        TraceRecord(40.5, 1000, 5, (0, 2)),
    ]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "t.jsonl line 2: not valid JSON"),
        ("[1, 2]", "t.jsonl line 2: expected a JSON object, got list"),
        (line(input_length=...), "t.jsonl line 2: missing field 'input_length'"),
        (line(input_length=0), "line 2: field 'input_length' must be an integer >= 1, got 0"),
        (line(output_length="5"), "field 'output_length' must be an integer >= 1, got '5'"),
        (line(output_length=True), "field 'output_length' must be an integer >= 1, got True"),
        (line(input_length=2.5), "field 'input_length' must be an integer >= 1, got 2.5"),
        (line(timestamp="0"), "t.jsonl line 2: field 'timestamp' must be a number (ms), got '0'"),
        (line(timestamp=-1), "field 'timestamp' must be finite and >= 0, got -1"),
        (line(hash_ids=[0, -1]), "t.jsonl line 2: field 'hash_ids' must be a list of integers"),
        (line(hash_ids="0,1"), "field 'hash_ids' must be a list of integers >= 0, got '0,1'"),
        (line(hash_ids=[0, 1, 2]), "field 'hash_ids' has 3 ids, more than the 2 blocks"),
    ],
)
def test_malformed_line_names_line_and_field(bad: str, message: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_trace([line(), bad, line()], "t.jsonl")
    assert message in str(info.value)


def test_timestamps_must_not_go_back() -> None:
    with pytest.raises(TraceError, match=r"line 3: field 'timestamp' goes back in time"):
        parse_trace([line(timestamp=10), "", line(timestamp=5)], "t.jsonl")


def test_empty_and_missing_traces() -> None:
    with pytest.raises(TraceError, match="has no requests"):
        parse_trace(["", "\n"], "empty.jsonl")
    with pytest.raises(TraceError, match=r"cannot read trace /nonexistent\.jsonl"):
        load_trace("/nonexistent.jsonl")


def test_the_mooncake_synthetic_trace_loads() -> None:
    if not MOONCAKE.exists():
        pytest.fail(f"the repository's trace is missing: {MOONCAKE} (set KVFLOW_TRACES_DIR)")
    records = load_trace(MOONCAKE)
    assert len(records) == 3993  # as its README says
    assert records[0] == TraceRecord(0.0, 40160, 6, tuple(range(79)))
    assert records[-1].timestamp_ms / 1e3 == pytest.approx(1022, abs=1)


def test_the_default_trace_is_the_repositorys() -> None:
    """`kvflow sim compare --workloads mooncake` and the autoscaling runs read this one
    when no --trace is given: in a source checkout it is the trace that ships."""
    shipped = Path(__file__).parents[2] / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"
    assert shipped.resolve() == MOONCAKE_TRACE
    assert MOONCAKE_TRACE.is_file()
