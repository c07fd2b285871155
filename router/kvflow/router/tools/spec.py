"""``tools`` and ``tool_choice`` -> typed records. Pure; 400s name the parameter."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import as_mapping, invalid_type

# OpenAI's rule, matched whole (fullmatch: "^...$" admitted a final newline).
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's limit

ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters_json: str  # the JSON Schema of the arguments, as compact JSON text
    strict: bool = False

    @property
    def parameters(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request shape: what chat templates expect in ``tools``."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    name: str | None = None  # the function, when mode is "named"


def parse_tools(value: object) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_type("tools", "an array", value)
    if len(value) > MAX_TOOLS:
        raise invalid_request(
            f"Invalid 'tools': at most {MAX_TOOLS} tools, got {len(value)}.", param="tools"
        )
    tools: list[ToolSpec] = []
    for i, raw in enumerate(value):
        tool = as_mapping(raw, f"tools[{i}]")
        if tool.get("type") != "function":
            raise unsupported_parameter(
                f"tools[{i}].type", f"'{tool.get('type')}' is not supported: only 'function'"
            )
        fn = as_mapping(tool.get("function"), f"tools[{i}].function")
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise invalid_request(
                f"Invalid 'tools[{i}].function.name': expected 1-64 letters, digits, '_' or "
                f"'-', got {name!r}.",
                param=f"tools[{i}].function.name",
            )
        if any(t.name == name for t in tools):
            raise invalid_request(
                f"Invalid 'tools': the function name '{name}' appears twice.", param="tools"
            )
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise invalid_type(f"tools[{i}].function.description", "a string", description)
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        param_name = f"tools[{i}].function.parameters"
        if not isinstance(params, dict):
            raise invalid_type(param_name, "a JSON Schema object", params)
        for defs in ("$defs", "definitions"):
            # Hoisted by name when a call is forced (tools/constrain.py): a map, or a 400.
            if defs in params and not isinstance(params[defs], dict):
                raise invalid_type(f"{param_name}.{defs}", "an object of schemas", params[defs])
        # Compiled later, off the event loop (serving/prepare.py); sized by the caller.
        strict = fn.get("strict", False)
        if strict is not None and not isinstance(strict, bool):
            raise invalid_type(f"tools[{i}].function.strict", "a boolean", strict)
        compact = json.dumps(params, separators=(",", ":"))
        tools.append(ToolSpec(name, description, compact, bool(strict)))
    return tuple(tools)


def parse_tool_choice(value: object, tools: tuple[ToolSpec, ...]) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("none", "auto", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict):
        spec = as_mapping(value, "tool_choice")
        fn = as_mapping(spec.get("function"), "tool_choice.function")
        if spec.get("type") != "function" or not isinstance(fn.get("name"), str):
            raise invalid_request(
                "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}.',
                param="tool_choice",
            )
        choice = ToolChoice("named", fn["name"])
    else:
        raise invalid_type("tool_choice", "a string or an object", value)
    if choice.mode in ("required", "named") and not tools:
        raise invalid_request(
            f"Invalid 'tool_choice': '{choice.mode if choice.mode == 'required' else choice.name}'"
            " needs 'tools'.",
            param="tool_choice",
        )
    if choice.mode == "named" and not any(t.name == choice.name for t in tools):
        raise invalid_request(
            f"Invalid 'tool_choice': no tool named '{choice.name}' in 'tools' "
            f"({', '.join(t.name for t in tools)}).",
            param="tool_choice.function.name",
        )
    return choice
