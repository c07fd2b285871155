"""The typed-record -> OpenAPI generator and JSON conversion (pure)."""

# schema.field() returns a dataclasses.field; RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from kvflow.operator.api.schema import (
    CelRule,
    JsonObject,
    Quantity,
    SchemaError,
    camel,
    cel,
    field,
    from_json,
    record_schema,
    to_json,
)


@dataclass(frozen=True)
class Inner:
    """An inner record."""

    size_gib: float = field("Size, GiB.", 1.5, json_name="sizeGiB", minimum=0)
    tags: list[str] = field("Tags.", [])


@cel(CelRule("self.low <= self.high", "low must not exceed high", ".low"))
@dataclass(frozen=True)
class Outer:
    """An outer record."""

    name: str = field("The name.", min_length=1, pattern="^[a-z]+$")
    low: int = field("Low.", 0)
    high: int = field("High.", 4, maximum=9)
    kind: Literal["a", "b"] = field("Kind.", "a")
    inner: Inner = field("Nested, with a default.", Inner())
    extra: JsonObject | None = field("Anything.", None)
    limits: dict[str, Quantity] = field("Quantities.", {})


def test_record_schema_is_structural_with_descriptions_defaults_and_rules() -> None:
    assert record_schema(Outer) == {
        "type": "object",
        "description": "An outer record.",
        "properties": {
            "name": {
                "description": "The name.", "type": "string", "minLength": 1,
                "pattern": "^[a-z]+$",
            },
            "low": {"description": "Low.", "type": "integer", "format": "int64", "default": 0},
            "high": {
                "description": "High.", "type": "integer", "format": "int64", "default": 4,
                "maximum": 9,
            },
            "kind": {"description": "Kind.", "type": "string", "enum": ["a", "b"], "default": "a"},
            "inner": {
                "description": "Nested, with a default.",
                "type": "object",
                "properties": {
                    "sizeGiB": {
                        "description": "Size, GiB.", "type": "number", "default": 1.5,
                        "minimum": 0,
                    },
                    "tags": {"description": "Tags.", "type": "array", "items": {"type": "string"}},
                },
                # the record default in full, less empty lists and maps
                "default": {"sizeGiB": 1.5},
            },
            "extra": {
                "description": "Anything.",
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "limits": {
                "description": "Quantities.",
                "type": "object",
                "additionalProperties": {
                    "anyOf": [{"type": "integer"}, {"type": "string"}],
                    "x-kubernetes-int-or-string": True,
                },
            },
        },
        "required": ["name"],
        "x-kubernetes-validations": [
            {
                "rule": "self.low <= self.high",
                "message": "low must not exceed high",
                "fieldPath": ".low",
            }
        ],
    }  # fmt: skip


def test_from_json_fills_defaults_and_converts_types() -> None:
    outer = from_json(Outer, {"name": "x", "inner": {"sizeGiB": 2}, "limits": {"cpu": 2}})
    assert outer == Outer(name="x", inner=Inner(size_gib=2.0), limits={"cpu": "2"})
    assert isinstance(outer.inner.size_gib, float)
    assert outer.inner.tags == [] and outer.inner.tags is not Inner().tags  # no shared default


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "Outer.name: required"),
        ({"name": "x", "kind": "c"}, "Outer.kind: 'c' is not one of ['a', 'b']"),
        ({"name": "x", "low": True}, "Outer.low: expected an integer"),
        ({"name": "x", "inner": {"tags": "t"}}, "Outer.inner.tags: expected"),
        ({"name": None}, "Outer.name: must not be null"),
    ],
)
def test_from_json_names_the_bad_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(SchemaError, match="^" + message.replace("[", r"\[").replace("]", r"\]")):
        from_json(Outer, data)


def test_to_json_round_trips_and_drops_none() -> None:
    outer = Outer(name="x", inner=Inner(tags=["t"]))
    data = to_json(outer)
    assert "extra" not in data
    assert data["inner"] == {"sizeGiB": 1.5, "tags": ["t"]}
    assert from_json(Outer, data) == outer


def test_camel() -> None:
    assert camel("max_num_batched_tokens") == "maxNumBatchedTokens"
    assert camel("replicas") == "replicas"
