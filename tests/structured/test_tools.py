"""Tool calling with the official openai client against a real worker: forced calls (named,
required, parallel or not) streamed and not, the conversation coming back with tool calls
and tool results, and malformed tools refused."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}, "hour24": {"type": "boolean"}},
    "required": ["zone", "hour24"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} tool", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_non_streaming(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=100, n=2
    )
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert [c.function.name for c in calls] == ["get_weather"]
        check_calls(calls)


def test_named_function_streams_argument_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=100,
        stream=True,
    )  # fmt: skip
    pieces = [c.choices[0] for c in stream if c.choices]
    call_deltas = [d for p in pieces for d in (p.delta.tool_calls or [])]
    # As OpenAI streams: the first piece has the id, type and name; later pieces only
    # append arguments, and there are several of them.
    first, rest = call_deltas[0], call_deltas[1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(rest) >= 2 and all(d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in call_deltas)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert pieces[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=300,
        parallel_tool_calls=parallel, seed=3,
    )  # fmt: skip
    choice = response.choices[0]
    calls = choice.message.tool_calls or []
    check_calls(calls)
    if not parallel:
        assert len(calls) == 1
    assert choice.finish_reason == "tool_calls"


def test_required_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs: Any = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                   "tool_choice": "required", "max_tokens": 300, "seed": 11,
                   "temperature": 0}  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or "" if d.function else ""
            call["arguments"] += d.function.arguments or "" if d.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole
    ]


def test_a_conversation_with_tool_calls_and_results(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=5
    )
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_and_no_tools_give_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert response.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                                       {"type": "objekt"}}}]},
         "tools[0].function.parameters", "objekt"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
         "tools[0].function.name", "letters"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only 'function'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name", "no tool named 'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", "one format at a time"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "string"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}],
          "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters", "object"),
    ],
)  # fmt: skip
def test_malformed_tools_are_a_400(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, fragment: str
) -> None:
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == param
    assert fragment in body["message"]


def test_openai_parse_helper_with_pydantic_tools(client: openai.OpenAI) -> None:
    import pydantic

    class Lookup(pydantic.BaseModel):
        country: str = pydantic.Field(max_length=8)
        page: int = pydantic.Field(ge=1, le=3)

    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=100,
        tools=[openai.pydantic_function_tool(Lookup)],
        tool_choice={"type": "function", "function": {"name": "Lookup"}},
    )  # fmt: skip
    calls = completion.choices[0].message.tool_calls or []
    assert len(calls) == 1
    assert isinstance(calls[0].function.parsed_arguments, Lookup)
