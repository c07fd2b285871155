"""Typed reads of a JSON request body, with OpenAI-style errors naming the parameter.

JSON's `true` is a Python int; every integer and number read here refuses booleans, so a
client sending `"max_tokens": true` gets a 400 instead of one token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvflow.router.protocol.errors import ApiError, invalid_request, unsupported_parameter

_TYPE_NAMES = {
    bool: "a boolean",
    int: "an integer",
    float: "a decimal",
    str: "a string",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _type_name(value: object) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def invalid_type(param: str, expected: str, value: object) -> ApiError:
    return invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {_type_name(value)} instead.",
        param=param,
        code="invalid_type",
    )


def out_of_range(param: str, value: object, low: float | None, high: float | None) -> ApiError:
    bounds = " and ".join(
        part
        for part in (
            f">= {low:g}" if low is not None else "",
            f"<= {high:g}" if high is not None else "",
        )
        if part
    )
    return invalid_request(
        f"Invalid '{param}': expected a value {bounds}, but got {value} instead.",
        param=param,
        code="invalid_value",
    )


class Fields:
    """Reads parameters out of a body and remembers which ones were understood."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise invalid_request(
                "The request body must be a JSON object; see the OpenAI API reference for "
                "this endpoint's parameters."
            )
        self._body: dict[str, Any] = body
        self._seen: set[str] = set()

    def has(self, name: str) -> bool:
        return self._body.get(name) is not None

    def raw(self, name: str) -> Any:
        self._seen.add(name)
        return self._body.get(name)

    def required(self, name: str) -> Any:
        value = self.raw(name)
        if value is None:
            raise invalid_request(f"Missing required parameter: '{name}'.", param=name)
        return value

    def string(self, name: str, *, required: bool = False) -> str | None:
        value = self.required(name) if required else self.raw(name)
        if value is None or isinstance(value, str):
            return value
        raise invalid_type(name, "a string", value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name)
        if value is None:
            return default
        if isinstance(value, bool):
            return value
        raise invalid_type(name, "a boolean", value)

    def integer(self, name: str, *, low: int | None = None, high: int | None = None) -> int | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_type(name, "an integer", value)
        if (low is not None and value < low) or (high is not None and value > high):
            raise out_of_range(name, value, low, high)
        return value

    def number(
        self, name: str, *, low: float | None = None, high: float | None = None
    ) -> float | None:
        value = self.raw(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid_type(name, "a decimal", value)
        if not math.isfinite(value):  # 1e400 parses as inf (NaN is refused as not JSON)
            raise invalid_request(
                f"Invalid '{name}': expected a finite number, but got {value} instead.",
                param=name,
                code="invalid_value",
            )
        if (low is not None and value < low) or (high is not None and value > high):
            raise out_of_range(name, value, low, high)
        return float(value)

    def ignore(self, *names: str) -> None:
        """Parameters that change nothing here (``user``, ``metadata``...): accepted as is."""
        self._seen.update(names)

    def reject_if_set(self, name: str, why: str, *, allowed: tuple[object, ...] = ()) -> None:
        """A parameter we cannot honour: a 400 unless it is absent or a harmless value."""
        value = self.raw(name)
        if value is None or value in allowed or value in ({}, []):
            return
        raise unsupported_parameter(name, why)

    def reject_unknown(self) -> None:
        for name in self._body:
            if name not in self._seen:
                # OpenAI's own wording, so clients' error handling recognises it.
                raise invalid_request(
                    f"Unrecognized request argument supplied: {name}",
                    param=name,
                    code="unknown_parameter",
                )


def as_mapping(value: object, param: str) -> Mapping[str, Any]:
    if isinstance(value, dict):
        return value
    raise invalid_type(param, "an object", value)
