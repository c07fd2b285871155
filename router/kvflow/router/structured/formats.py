"""``response_format`` (OpenAI) and ``structured_outputs`` (kvflow's extension, named and
shaped as vLLM's) -> an ``OutputConstraint``. Pure; 400s name the parameter.

Nothing is compiled here: parsing runs on the event loop, and a grammar can take seconds
to compile. The size caps are checked by protocol/requests.py, the compile by
serving/prepare.py (off the loop, with a time limit)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from kvflow.router.protocol.errors import ApiError, invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import as_mapping, invalid_type
from kvflow.router.structured.constraint import OutputConstraint

_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name
# structured_outputs keys: vLLM's names. `grammar` takes GBNF or Lark.
_EXTENSION_KEYS = ("json", "regex", "grammar", "choice", "json_object")


def _unknown(keys: Mapping[str, Any], known: set[str], param: str) -> ApiError | None:
    extra = sorted(set(keys) - known)
    return unsupported_parameter(f"{param}.{extra[0]}") if extra else None


def parse_response_format(value: object) -> OutputConstraint | None:
    """None for ``{"type": "text"}`` (or no value)."""
    if value is None:
        return None
    fmt = as_mapping(value, "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint("json_object")
    if kind != "json_schema":
        raise invalid_request(
            "Invalid 'response_format.type': expected one of 'text', 'json_object', "
            f"'json_schema', got {kind!r}.",
            param="response_format.type",
        )
    if "json_schema" not in fmt:
        raise invalid_request(
            "Missing required parameter: 'response_format.json_schema'.",
            param="response_format.json_schema",
        )
    spec = as_mapping(fmt["json_schema"], "response_format.json_schema")
    problem = _unknown(
        spec, {"name", "description", "schema", "strict"}, "response_format.json_schema"
    )
    if problem is not None:
        raise problem
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise invalid_request(
            "Invalid 'response_format.json_schema.name': expected 1-64 letters, digits, "
            f"'_' or '-', got {name!r}.",
            param="response_format.json_schema.name",
        )
    strict = spec.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise invalid_type("response_format.json_schema.strict", "a boolean", strict)
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise invalid_type("response_format.json_schema.schema", "an object", schema)
    # strict or not, the output follows the schema: kvflow always constrains.
    return OutputConstraint.json_schema(schema, param="response_format.json_schema.schema")


def parse_structured_outputs(value: object) -> OutputConstraint | None:
    """kvflow's extension: exactly one of ``json`` (a schema), ``regex``, ``grammar``
    (GBNF or Lark), ``choice`` (strings), ``json_object`` (true)."""
    if value is None:
        return None
    spec = as_mapping(value, "structured_outputs")
    problem = _unknown(spec, set(_EXTENSION_KEYS), "structured_outputs")
    if problem is not None:
        raise problem
    given = [k for k in _EXTENSION_KEYS if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid_request(
            "Invalid 'structured_outputs': set exactly one of "
            f"{', '.join(_EXTENSION_KEYS)}; got {given or 'none'}.",
            param="structured_outputs",
        )
    key = given[0]
    param = f"structured_outputs.{key}"
    raw = spec[key]
    constraint: OutputConstraint
    if key == "json":
        try:
            schema = json.loads(raw) if isinstance(raw, str) else raw
        except (ValueError, RecursionError) as err:  # RecursionError: nested too deep
            raise invalid_request(f"Invalid '{param}': not JSON: {err}.", param=param) from err
        if not isinstance(schema, dict):
            raise invalid_type(param, "a JSON Schema object", raw)
        constraint = OutputConstraint.json_schema(schema, param=param)
    elif key == "json_object":
        if raw is not True:
            raise invalid_type(param, "true", raw)
        constraint = OutputConstraint("json_object", param=param)
    elif key == "choice":
        if not isinstance(raw, list) or not raw or not all(isinstance(c, str) for c in raw):
            raise invalid_type(param, "a non-empty array of strings", raw)
        lark = "start: " + " | ".join(json.dumps(c) for c in raw)
        constraint = OutputConstraint("lark", lark, param=param)
    else:
        if not isinstance(raw, str) or not raw:
            raise invalid_type(param, "a non-empty string", raw)
        constraint = OutputConstraint("regex" if key == "regex" else "ebnf", raw, param=param)
    return constraint
