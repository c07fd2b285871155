"""Forced tool calls (``tool_choice`` ``required`` or a named function) as output grammars.

The output is then plain JSON whatever the model family: for a named function, its
arguments object; for ``required``, an array of ``{"name", "arguments"}`` objects (one at
most without ``parallel_tool_calls``). The gateway builds the tool calls from that JSON, so
even a 135M model (or random weights) returns calls that parse and match the schemas.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.router.structured.constraint import OutputConstraint
from kvflow.router.tools.spec import ToolChoice, ToolSpec


def _rebase_refs(node: Any, base: str) -> Any:
    """A copy of ``node`` whose local refs (``#`` and ``#/...``, relative to the tool's own
    schema) point under ``base``, where the tool's schema now is."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if (
                key == "$ref"
                and isinstance(value, str)
                and (value == "#" or value.startswith("#/"))
            ):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(node, list):
        return [_rebase_refs(v, base) for v in node]
    return node


def _call_schema(tool: ToolSpec, index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """One call's object. The tool's schema moves whole to the root's ``$defs`` (its local
    refs, ``#`` itself and ``#/$defs/X`` or ``#/properties/a`` alike, were relative to its
    own root, which is no longer the document's) and the call's arguments refer to it."""
    name = f"tool{index}"
    base = f"#/$defs/{name}"
    defs[name] = _rebase_refs(tool.parameters, base)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": {"$ref": base}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_constraint(
    tools: tuple[ToolSpec, ...], choice: ToolChoice, *, parallel: bool
) -> OutputConstraint | None:
    """The grammar of a forced call, or None when the model chooses (``auto``/``none``)."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return OutputConstraint("json_schema", tool.parameters_json)
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    calls = [_call_schema(t, i, defs) for i, t in enumerate(tools)]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return OutputConstraint("json_schema", json.dumps(schema, separators=(",", ":")))
