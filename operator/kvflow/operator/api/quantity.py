"""Kubernetes resource quantities ("500m", "4Gi", "1e3") as exact fractions (pure).

Only what the operator needs to compare requests with limits and the KV cache with a
memory limit; the API server remains the authority on the exact grammar.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(\d+(\.\d*)?|\.\d+))"
    r"(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?\d+)?$"
)


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def parse_quantity(text: str | int) -> Fraction:
    """The value of a quantity in base units (bytes, cores): "4Gi" -> 4294967296."""
    match = _QUANTITY.match(str(text).strip())
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity (examples: 500m, 2, 8Gi, 1G)")
    number = Fraction(match["number"])
    suffix = match["suffix"] or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * Fraction(10) ** int(suffix[1:])  # an exponent: 1e3, 5E-2
