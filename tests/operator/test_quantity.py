from __future__ import annotations

from fractions import Fraction

import pytest

from kvflow.operator.api.quantity import QuantityError, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", 4 * 2**30),
        ("1.5Gi", 3 * 2**29),
        ("500m", Fraction(1, 2)),
        ("2", 2),
        (2, 2),
        ("1G", 10**9),
        ("1e3", 1000),
        ("1E3", 1000),
        ("1E", 10**18),
        ("128974848", 128974848),
        ("129M", 129 * 10**6),
        (".5", Fraction(1, 2)),
    ],
)
def test_parse_quantity(text: str | int, value: int | Fraction) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["4 GB", "Gi", "", "1.2.3", "4gi"])
def test_rejects_what_kubernetes_rejects(text: str) -> None:
    with pytest.raises(QuantityError, match="is not a quantity"):
        parse_quantity(text)
