"""Inputs that answered 500 where the request (or the model's output) was at fault: each is
now a 400 naming the parameter, or, for the model's output, not taken as a tool call."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import parse_chat_request
from kvflow.router.structured.constraint import check_constraint
from kvflow.router.tools.constrain import forced_call_constraint
from kvflow.router.tools.parsers import call_from_value

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**fields: Any) -> Any:
    return parse_chat_request({"model": "m", "messages": MESSAGES, **fields})


@pytest.mark.parametrize("defs", ["$defs", "definitions"])
def test_a_tools_definitions_must_be_an_object(defs: str) -> None:
    """Hoisted by name when a call is forced: a list of them was an AttributeError."""
    params = {"type": "object", "properties": {}, defs: []}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(ApiError) as refused:
        _chat(tools=tools, tool_choice="required")
    assert refused.value.status == 400
    assert refused.value.param == f"tools[0].function.parameters.{defs}"
    # As an object it is hoisted and the forced call compiles to a schema.
    params[defs] = {"s": {"type": "string"}}
    parsed = _chat(tools=tools, tool_choice="required")
    forced = forced_call_constraint(parsed.tools, parsed.tool_choice, parallel=False)
    assert forced is not None
    check_constraint(forced)  # compiles


def test_a_logit_bias_token_id_of_thousands_of_digits_is_a_400() -> None:
    """int() refuses past 4,300 digits with a ValueError, which was a 500."""
    for key in ("9" * 5000, "12345678901"):
        with pytest.raises(ApiError) as refused:
            _chat(logit_bias={key: 1})
        assert (refused.value.status, refused.value.param) == (400, "logit_bias")
    assert _chat(logit_bias={"4294967295": 1}).sampling.logit_bias == ((4294967295, 1.0),)


def test_a_tool_call_with_a_lone_surrogate_is_not_taken_as_a_call() -> None:
    """The model wrote "\\ud800" in its arguments: decoded, no UTF-8 body could carry it
    (the non-streamed answer was a 500); the text stays the answer's content."""
    assert call_from_value({"name": "f", "arguments": {"q": "\ud800"}}) is None
    assert call_from_value({"name": "f\udfff", "arguments": {}}) is None
    call = call_from_value({"name": "f", "arguments": {"q": "Zürich"}})
    assert call is not None and call.arguments == '{"q": "Zürich"}'


@pytest.mark.parametrize(
    ("parameters", "valid", "invalid"),
    [
        # A recursive tool: "#" is the tool's own root, not the array of calls.
        ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
          "additionalProperties": False},
         {"kids": [{"kids": []}]}, {"kids": [[{"name": "f", "arguments": {}}]]}),
        # A pointer into the tool's own properties (a 400 before: "does not exist").
        ({"type": "object",
          "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
          "required": ["b"]},
         {"b": 3}, {"b": "three"}),
        # Its own definitions, under either name.
        ({"type": "object", "properties": {"x": {"$ref": "#/definitions/n"}},
          "definitions": {"n": {"type": "number"}}, "required": ["x"]},
         {"x": 1.5}, {"x": "1.5"}),
    ],
)  # fmt: skip
def test_a_required_calls_refs_mean_what_they_meant_in_the_tool(
    parameters: dict[str, Any], valid: Any, invalid: Any
) -> None:
    """tool_choice "required" moves each tool's schema into an array of calls: its local
    refs must still resolve inside the tool (they were rewritten for $defs only)."""
    import jsonschema

    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    parsed = _chat(tools=tools, tool_choice="required")
    forced = forced_call_constraint(parsed.tools, parsed.tool_choice, parallel=False)
    assert forced is not None
    check_constraint(forced)  # compiles, where "#/properties/a" was a 400
    schema = json.loads(forced.source)
    jsonschema.validate([{"name": "f", "arguments": valid}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "arguments": invalid}], schema)


def test_a_function_name_with_a_final_newline_is_a_400() -> None:
    """OpenAI's rule is the whole name; "^...$" matched "f\n" too."""
    with pytest.raises(ApiError) as refused:
        _chat(tools=[{"type": "function", "function": {"name": "f\n", "parameters": {}}}])
    assert refused.value.status == 400
