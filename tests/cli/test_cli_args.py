"""The argparse types the command lines share (kvflow.proto.cli_args): the bounds each
accepts and the message a refused value gets."""

from __future__ import annotations

import argparse
import math

import pytest

from kvflow.proto.cli_args import fraction, number_of, port_number, positive_int, seconds


@pytest.mark.parametrize("text", ["1", "0.5", "1e3"])
def test_an_amount_above_zero_is_taken(text: str) -> None:
    assert number_of("MiB", allow_zero=False)(text) == float(text)


@pytest.mark.parametrize("text", ["0", "-0", "-1", "nan", "inf", "-inf", "x", ""])
def test_an_amount_at_or_below_zero_or_not_finite_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        number_of("MiB", allow_zero=False)(text)
    assert str(refused.value) == f"must be a number of MiB > 0, got {text!r}"


def test_zero_seconds_is_taken_only_where_zero_is_allowed() -> None:
    assert seconds(allow_zero=True)("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError, match=r"seconds >= 0, got '-1'"):
        seconds(allow_zero=True)("-1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"seconds > 0, got '0'"):
        seconds(allow_zero=False)("0")


@pytest.mark.parametrize(("text", "value"), [("1", 1.0), ("0.25", 0.25), ("1e-9", 1e-9)])
def test_a_fraction_in_zero_to_one_is_taken(text: str, value: float) -> None:
    assert math.isclose(fraction(text), value)


@pytest.mark.parametrize("text", ["0", "1.5", "-0.1", "nan", "inf", "half"])
def test_a_fraction_outside_zero_to_one_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        fraction(text)
    assert str(refused.value) == f"must be a fraction in (0, 1], got {text!r}"


@pytest.mark.parametrize("text", ["0", "-3", "1.5", "x"])
def test_a_count_below_one_or_not_whole_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer >= 1"):
        positive_int(text)


def test_ports_from_any_free_one_to_the_last() -> None:
    assert [port_number(p) for p in ("0", "1", "8000", "65535")] == [0, 1, 8000, 65535]
    for bad in ("65536", "-1", "80.5", "http", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="from 0 \\(any free port\\)"):
            port_number(bad)
