"""The Responses API's translation to and from chat completions (protocol/responses_api.py),
on bodies and chunks written here; tests/gateway/test_responses_api.py runs it end to end."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.response_events import ResponseEvents, response_object, sse
from kvflow.router.protocol.responses_api import (
    ResponseEcho,
    chat_request,
    continued,
    conversation,
    renamed,
)

TOOL = {"type": "function", "name": "f", "description": "d",
        "parameters": {"type": "object"}, "strict": True}  # fmt: skip


def test_input_items_become_chat_messages_and_parallel_calls_one_assistant_turn() -> None:
    chat, echo = chat_request({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "stream": True,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"x\":1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "t"}, {"type": "input_text", "text": "wo"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "done"}]},
        ],
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
        "metadata": {"k": "v"}, "store": False, "prompt_cache_key": "u1",
    })  # fmt: skip
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
    ]  # fmt: skip
    assert chat["max_tokens"] == 9 and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object"},
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "s", "schema": {"type": "object"}},
    }
    assert chat["prompt_cache_key"] == "u1" and "store" not in chat and "metadata" not in chat
    assert echo.instructions == "Be brief." and echo.metadata == {"k": "v"}
    assert echo.store is False and echo.input_messages == chat["messages"][1:]
    assert echo.tools == [TOOL] and echo.max_output_tokens == 9  # fmt: skip


def test_a_string_input_is_one_user_message_and_text_format_text_asks_nothing() -> None:
    chat, echo = chat_request({"model": "m", "input": "hi", "text": {"format": {"type": "text"}}})
    assert chat == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert echo.tool_choice == "auto" and echo.parallel_tool_calls is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include[0]"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"type": "reasoning", "id": "r"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "n": 2}, "n"),
        ({}, "input"),
    ],
)  # fmt: skip
def test_what_cannot_be_asked_is_a_400_naming_the_responses_parameter(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ApiError) as caught:
        chat_request({"model": "m", **body})
    assert caught.value.status == 400 and caught.value.param == param


def test_chat_errors_name_the_responses_parameters() -> None:
    error = renamed(ApiError(400, "Invalid 'max_tokens': too big; reduce max_tokens.",
                             param="max_tokens"))  # fmt: skip
    assert error.param == "max_output_tokens"
    assert error.message == "Invalid 'max_output_tokens': too big; reduce max_output_tokens."
    assert renamed(ApiError(400, "x", param="messages[2].content")).param == "input"
    schema = renamed(ApiError(400, "Bad 'response_format.json_schema'.",
                              param="response_format.json_schema"))  # fmt: skip
    assert schema.param == "text.format.json_schema"
    assert schema.message == "Bad 'text.format.json_schema'."
    assert renamed(ApiError(400, "x", param="temperature")).param == "temperature"


CHAT = {"id": "chatcmpl-abc", "created": 7, "model": "m",
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "prompt_tokens_details": {"cached_tokens": 4}}}  # fmt: skip


def test_a_whole_chat_completion_becomes_a_response() -> None:
    chat = {
        **CHAT,
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": "Let me look.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
    }
    response = response_object(chat, ResponseEcho(metadata={"k": "v"}))
    assert response["id"] == "resp_abc" and response["created_at"] == 7
    assert response["status"] == "completed" and response["store"] is True
    assert response["output"] == [
        {"type": "message", "id": "msg_abc", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [],
                      "logprobs": []}]},
        {"type": "function_call", "id": "fc_abc_0", "call_id": "call_1", "name": "f",
         "arguments": "{}", "status": "completed"},
    ]  # fmt: skip
    assert response["usage"] == {
        "input_tokens": 5, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8,
    }  # fmt: skip
    assert response["metadata"] == {"k": "v"}
    cut = {**CHAT, "choices": [{"index": 0, "finish_reason": "length",
                                "message": {"role": "assistant", "content": "Par"}}]}  # fmt: skip
    incomplete = response_object(cut, ResponseEcho())
    assert incomplete["status"] == "incomplete"
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {**CHAT, "usage": None,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip


def _call(index: int, call_id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    call: dict[str, Any] = {"index": index, "function": function}
    if call_id is not None:
        call.update(id=call_id, type="function")
    return {"tool_calls": [call]}


def test_streamed_text_then_two_calls_close_each_item_before_the_next() -> None:
    events = ResponseEvents(ResponseEcho())
    out = []
    for chunk in (
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hm"}),
        _chunk({"content": "."}),
        _chunk(_call(0, "call_a", "f", '{"x"')),
        _chunk(_call(0, None, None, ":1}")),
        _chunk(_call(1, "call_b", "g", "{}")),
        _chunk({}, "tool_calls"),
        {**CHAT, "choices": []},  # the usage chunk
    ):
        out += events.chunk(chunk)
    out += events.end()
    assert [(e["type"], e.get("output_index")) for e in out] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.delta", 0),
        ("response.output_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.completed", None),
    ]  # fmt: skip
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hm."
    assert final["output"][1]["arguments"] == '{"x":1}' and final["output"][1]["name"] == "f"
    assert final["output"][2]["call_id"] == "call_b"
    assert final["usage"]["output_tokens"] == 3 and final["id"] == "resp_abc"
    assert out[12]["arguments"] == '{"x":1}'


def test_a_stream_cut_by_length_ends_incomplete_and_an_empty_one_is_an_empty_message() -> None:
    events = ResponseEvents(ResponseEcho())
    out = events.chunk(_chunk({"role": "assistant", "content": ""}, "length")) + events.end()
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""
    assert ResponseEvents(ResponseEcho()).end() == []  # no chunk at all: nothing to end


def test_a_failure_mid_stream_is_an_error_event_and_response_failed() -> None:
    events = ResponseEvents(ResponseEcho())
    events.chunk(_chunk({"content": "Pa"}))
    out = events.chunk({"error": {"message": "worker lost", "type": "server_error",
                                  "param": None, "code": "worker_unavailable"}})  # fmt: skip
    assert [e["type"] for e in out] == ["error", "response.failed"]
    assert out[0]["code"] == "worker_unavailable" and out[0]["message"] == "worker lost"
    failed = out[1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "worker lost"}


def test_an_event_is_framed_with_its_type_as_the_sse_event_name() -> None:
    frame = sse({"type": "response.output_text.delta", "sequence_number": 3, "delta": "é"})
    assert frame == ('event: response.output_text.delta\n'
                     'data: {"type":"response.output_text.delta","sequence_number":3,'
                     '"delta":"é"}\n\n').encode()  # fmt: skip


def test_included_logprobs_ask_the_chat_path_and_come_back_on_the_output_text() -> None:
    include = ["message.output_text.logprobs"]
    chat, _ = chat_request({"model": "m", "input": "x", "include": include, "top_logprobs": 2})
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    plain, _ = chat_request({"model": "m", "input": "x", "top_logprobs": 2})
    assert "logprobs" not in plain  # top_logprobs alone includes nothing, as OpenAI's
    entry = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
             "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}  # fmt: skip
    choice = {"index": 0, "finish_reason": "stop", "logprobs": {"content": [entry]},
              "message": {"role": "assistant", "content": "Hi"}}  # fmt: skip
    chat_answer = {**CHAT, "choices": [choice]}
    text = response_object(chat_answer, ResponseEcho())["output"][0]["content"][0]
    assert text["logprobs"] == [entry]
    events = ResponseEvents(ResponseEcho())
    streamed = events.chunk({**CHAT, "choices": [{"index": 0, "delta": {"content": "Hi"},
                                                  "logprobs": {"content": [entry]},
                                                  "finish_reason": None}]})  # fmt: skip
    streamed += events.end()
    delta = next(e for e in streamed if e["type"] == "response.output_text.delta")
    done = next(e for e in streamed if e["type"] == "response.output_text.done")
    assert delta["logprobs"] == done["logprobs"] == [entry]
    assert streamed[-1]["response"]["output"][0]["content"][0]["logprobs"] == [entry]


def test_a_continued_response_sees_the_stored_conversation_without_its_instructions() -> None:
    first_chat, first = chat_request(
        {"model": "m", "instructions": "Old.", "input": "Hi, I'm Ada."}
    )
    hello = {"role": "assistant", "content": "Hello Ada."}
    answered = {**CHAT, "choices": [{"index": 0, "finish_reason": "stop", "message": hello}]}
    kept = conversation(first, [], response_object(answered, first))
    assert kept == [{"role": "user", "content": "Hi, I'm Ada."},
                    {"role": "assistant", "content": "Hello Ada."}]  # fmt: skip
    chat, second = chat_request({"model": "m", "instructions": "New.", "input": "My name?",
                                 "previous_response_id": "resp_abc"})  # fmt: skip
    assert second.previous_response_id == "resp_abc"
    assert continued(chat, second, kept)["messages"] == [
        {"role": "system", "content": "New."},
        *kept,
        {"role": "user", "content": "My name?"},
    ]
    assert first_chat["messages"][0] == {"role": "system", "content": "Old."}
    # A response that called tools leaves its calls as the assistant's turn.
    called = {
        **CHAT,
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
            }
        ],
    }
    after = conversation(second, kept, response_object(called, second))
    assert after[-1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    assert after[:-1] == [*kept, {"role": "user", "content": "My name?"}]
