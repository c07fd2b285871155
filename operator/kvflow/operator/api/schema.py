"""Typed API records -> structural OpenAPI v3 schema, and JSON <-> records.

The InferencePool API is written once, as frozen dataclasses (`api/v1alpha1.py`). This
module turns them into the CRD's `openAPIV3Schema` (descriptions, defaults, enums, bounds,
CEL rules) and converts between the API server's JSON and the records, so the schema the
API server enforces and the types the operator reads cannot drift apart.

A field's JSON name is its camelCase name unless `json_name` says otherwise. A field with a
default is optional and the default goes into the schema, so the API server fills it in; a
record-typed field whose default is an empty record gets `default: {}`, which makes the API
server fill that record's own defaults too. `X | None = None` is optional with no default.

Pure: imports neither kopf nor kubernetes (held by import-linter).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NewType, TypeVar, Union, get_args, get_origin

Json = Any  # a JSON value as the API server sends it
JsonObject = NewType(
    "JsonObject", dict[str, Any]
)  # a nested Kubernetes type kept verbatim (affinity)
Quantity = NewType("Quantity", str)  # a resource quantity: "500m", "4Gi", or an integer

_META_KEY = "kvflow"


@dataclass(frozen=True)
class CelRule:
    """An `x-kubernetes-validations` rule; `message` is what the API server answers."""

    rule: str
    message: str
    field_path: str = ""


@dataclass(frozen=True)
class FieldInfo:
    description: str
    json_name: str = ""
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    min_length: int | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    pattern: str = ""
    map_keys: tuple[str, ...] = ()  # list of records merged by these keys (listType map)
    list_set: bool = False  # a list of unique scalars (listType set)
    item_pattern: str = ""  # pattern of each string item of a list
    item_max_length: int | None = None


def field(description: str, default: Any = dataclasses.MISSING, **info: Any) -> Any:
    """A documented record field. Mutable defaults (records, lists, dicts) are copied."""
    meta = {_META_KEY: FieldInfo(description=description, **info)}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        template = default
        return dataclasses.field(
            default_factory=lambda: _copy(template),
            metadata=meta,
        )
    return dataclasses.field(default=default, metadata=meta)


def cel(*rules: CelRule) -> Any:
    """Class decorator attaching CEL rules to a record's schema."""

    def attach(cls: type) -> type:
        cls.__cel_rules__ = rules  # type: ignore[attr-defined]
        return cls

    return attach


def _copy(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value)
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _info(f: dataclasses.Field[Any]) -> FieldInfo:
    info = f.metadata.get(_META_KEY)
    assert isinstance(info, FieldInfo), f"field {f.name} lacks a description: use schema.field()"
    return info


def json_name(f: dataclasses.Field[Any]) -> str:
    return _info(f).json_name or camel(f.name)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        assert len(args) == 1, f"only `X | None` unions are supported, got {tp}"
        return args[0], True
    return tp, False


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


# --- schema -------------------------------------------------------------------------------


def type_schema(tp: Any) -> dict[str, Json]:
    """The schema of a type, without description or default."""
    tp, _ = _strip_optional(tp)
    if tp is JsonObject:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if tp is Quantity:
        return {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
        }
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer", "format": "int64"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    origin = get_origin(tp)
    if origin is Literal:
        values = list(get_args(tp))
        assert all(isinstance(v, str) for v in values), f"enum values must be strings: {tp}"
        return {"type": "string", "enum": values}
    if origin is list:
        (item,) = get_args(tp)
        return {"type": "array", "items": type_schema(item)}
    if origin is dict:
        key, value = get_args(tp)
        assert key is str, f"map keys must be strings: {tp}"
        return {"type": "object", "additionalProperties": type_schema(value)}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return record_schema(tp)
    raise TypeError(f"no schema for {tp!r}")


def record_schema(cls: type) -> dict[str, Json]:
    hints = _hints(cls)
    properties: dict[str, Json] = {}
    required: list[str] = []
    for f in dataclasses.fields(cls):
        name = json_name(f)
        properties[name] = _field_schema(f, hints[f.name])
        if _default_of(f) is dataclasses.MISSING:
            required.append(name)
    schema: dict[str, Json] = {"type": "object"}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    schema["properties"] = properties
    if required:
        schema["required"] = required
    rules: tuple[CelRule, ...] = getattr(cls, "__cel_rules__", ())
    if rules:
        schema["x-kubernetes-validations"] = [_rule_json(r) for r in rules]
    return schema


def _rule_json(rule: CelRule) -> dict[str, str]:
    out = {"rule": rule.rule, "message": rule.message}
    if rule.field_path:
        out["fieldPath"] = rule.field_path
    return out


def _field_schema(f: dataclasses.Field[Any], tp: Any) -> dict[str, Json]:
    info = _info(f)
    schema = type_schema(tp)
    inner, _ = _strip_optional(tp)
    if dataclasses.is_dataclass(inner):
        # The record's own description is generic; the field's says what this use means.
        schema = {k: v for k, v in schema.items() if k != "description"}
    out: dict[str, Json] = {"description": " ".join(info.description.split())}
    out.update(schema)
    default = _default_of(f)
    # Empty lists and maps stay out of the schema: the records default them anyway, and
    # `kubectl get -o yaml` should not show a dozen `{}` and `[]` nobody wrote.
    if default not in (dataclasses.MISSING, None, [], {}):
        # A record default is written out in full (CEL rules judge a default as written,
        # before nested defaults apply), less the empty lists and maps.
        out["default"] = _without_empty(to_json(default))
    bounds = {
        "minimum": info.minimum,
        "maximum": info.maximum,
        "minLength": info.min_length,
        "maxLength": info.max_length,
        "minItems": info.min_items,
        "maxItems": info.max_items,
    }
    out.update({k: v for k, v in bounds.items() if v is not None})
    if info.exclusive_minimum:
        out["exclusiveMinimum"] = True
    if info.pattern:
        out["pattern"] = info.pattern
    if info.item_pattern:
        out["items"] = {**out["items"], "pattern": info.item_pattern}
    if info.item_max_length is not None:
        out["items"] = {**out["items"], "maxLength": info.item_max_length}
    if info.list_set:
        out["x-kubernetes-list-type"] = "set"
    if info.map_keys:
        out["x-kubernetes-list-type"] = "map"
        out["x-kubernetes-list-map-keys"] = list(info.map_keys)
    return out


def _without_empty(value: Json) -> Json:
    if isinstance(value, dict):
        pruned = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ({}, [])}
    return value


# --- JSON <-> records -----------------------------------------------------------------------

R = TypeVar("R")


def to_json(value: Any) -> Json:
    """A record (or plain value) as JSON; None-valued optional fields are left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Json] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if item is not None:
                out[json_name(f)] = to_json(item)
        return out
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


class SchemaError(ValueError):
    """JSON that does not fit the record types (the API server normally prevents this)."""


def from_json(cls: type[R], data: Mapping[str, Json]) -> R:
    """Build record `cls` from JSON, filling missing fields with their defaults."""
    return typing.cast(R, _convert(cls, data, cls.__name__))


def _convert(tp: Any, value: Json, where: str) -> Any:
    tp, optional = _strip_optional(tp)
    if value is None:
        if optional:
            return None
        raise SchemaError(f"{where}: must not be null")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise SchemaError(f"{where}: expected an object, got {value!r}")
        hints = _hints(tp)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(tp):
            name = json_name(f)
            if name in value:
                kwargs[f.name] = _convert(hints[f.name], value[name], f"{where}.{name}")
            elif _default_of(f) is dataclasses.MISSING:
                raise SchemaError(f"{where}.{name}: required")
        return tp(**kwargs)
    origin = get_origin(tp)
    if origin is list:
        (item,) = get_args(tp)
        items = _expect(value, list, where)
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(items)]
    if origin is dict:
        _, item = get_args(tp)
        entries = _expect(value, dict, where)
        return {k: _convert(item, v, f"{where}.{k}") for k, v in entries.items()}
    if origin is Literal:
        if value not in get_args(tp):
            raise SchemaError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if tp is JsonObject:
        return _expect(value, dict, where)
    if tp is Quantity:
        return str(_expect(value, (int, str), where))
    if tp is float:
        return float(_expect(value, (int, float), where))
    if tp is bool:
        return _expect(value, bool, where)
    if tp is int:
        if isinstance(value, bool):
            raise SchemaError(f"{where}: expected an integer, got {value!r}")
        return _expect(value, int, where)
    if tp is str:
        return _expect(value, str, where)
    raise TypeError(f"{where}: unsupported type {tp!r}")


def _expect(value: Json, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kind):
        raise SchemaError(f"{where}: expected {kind}, got {value!r}")
    return value
