"""JSON schemas for structured-output tests: nested objects, enums, arrays, bounds.

Strings and numbers are bounded (maxLength, enums, ranges) so that even a random-weight
model, which the grammar alone keeps valid, finishes in a few dozen tokens.
"""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
            "sunny": {"type": "boolean"},
        },
        "required": ["city", "celsius", "sunny"],
        "additionalProperties": False,
    },
    "nested_enum_array": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "role": {"enum": ["admin", "viewer", "editor"]},
                },
                "required": ["name", "role"],
                "additionalProperties": False,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 1,
                "maxItems": 4,
            },
        },
        "required": ["user", "scores"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99},
                "tag": {"enum": ["a", "b"]},
            },
            "required": ["id", "tag"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}
