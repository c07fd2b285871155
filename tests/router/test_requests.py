"""OpenAI request validation, table-driven: what parses to what, and which 400 says what."""

from __future__ import annotations

from typing import Any

import pytest

from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import (
    StreamOptions,
    check_logit_bias,
    parse_chat_request,
    parse_completion_request,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}


def test_chat_defaults() -> None:
    request = parse_chat_request(CHAT)
    assert request.model == "m"
    assert [m.as_template_dict() for m in request.messages] == [{"role": "user", "content": "hi"}]
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n, s.seed) == (
        None,
        None,
        None,
        0,
        1,
        None,
    )
    assert s.stop_strings == () and not s.logprobs and not request.stream


def test_chat_all_supported_parameters() -> None:
    request = parse_chat_request(
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": "ok", "name": "bot"},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "min_p": 0.1,
            "seed": -1,
            "stop": "\n",
            "stop_token_ids": [2, 5],
            "n": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "user": "u-1",
            "metadata": {"x": "y"},
            "frequency_penalty": 0,
            "tool_choice": "none",
            "response_format": {"type": "text"},
        }
    )
    assert [m.role for m in request.messages] == ["system", "user", "assistant"]
    assert request.messages[1].content == "ab"
    assert request.messages[2].as_template_dict() == {
        "role": "assistant",
        "content": "ok",
        "name": "bot",
    }
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (7, 0.0, 0.5, 40, 0.1)
    assert s.seed == 2**64 - 1
    assert s.stop_strings == ("\n",) and s.stop_token_ids == (2, 5)
    assert (s.n, s.logprobs, s.top_logprobs) == (3, True, 2)
    assert request.stream and request.include_usage


@pytest.mark.parametrize(
    ("patch", "param", "fragment"),
    [
        ({"model": None}, "model", "Missing required parameter"),
        ({"model": 3}, "model", "expected a string, but got an integer"),
        ({"messages": []}, "messages", "empty array"),
        ({"messages": "hi"}, "messages", "expected an array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "expected one of"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "string"),
        # Ignored on a user message, but still of the schema's type (schemathesis found it).
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": 0}]},
            "messages[0].tool_call_id",
            "string",
        ),
        # OpenAI: null (or absent) content only on an assistant message with tool calls.
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "null"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "null"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant"},
                    {"role": "user", "content": "b"},
                ]
            },
            "messages[1].content",
            "Only an assistant message with 'tool_calls'",
        ),
        (
            {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
            "messages[0].content",
            "null",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
            "text only",
        ),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": True}, "max_tokens", "got a boolean"),
        ({"max_tokens": 1.5}, "max_tokens", "expected an integer"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", "not both"),
        ({"temperature": 2.5}, "temperature", "<= 2"),
        ({"temperature": "hot"}, "temperature", "expected a decimal"),
        ({"top_p": -0.1}, "top_p", ">= 0"),
        ({"top_p": 0}, "top_p", "> 0 and <= 1"),  # no token at all: the worker refuses it
        ({"temperature": float("inf")}, "temperature", "finite"),  # how 1e400 parses
        ({"presence_penalty": float("-inf")}, "presence_penalty", "finite"),
        ({"n": 0}, "n", ">= 1"),
        ({"n": 129}, "n", "max_n = 128"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop": [1]}, "stop", "array of strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "array of token ids"),
        ({"top_logprobs": 3}, "top_logprobs", "requires 'logprobs'"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
            "stream_options.continuous_usage_stats",
            "expected a boolean",
        ),
        (
            {"stream": True, "stream_options": {"include_usage_stats": True}},
            "stream_options.include_usage_stats",
            "not supported",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "expected an object"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", "<= 2"),
        ({"presence_penalty": -2.1}, "presence_penalty", ">= -2"),
        ({"presence_penalty": "a lot"}, "presence_penalty", "expected a decimal"),
        ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ({"repetition_penalty": -1.2}, "repetition_penalty", "> 0"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"5": -100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "Invalid key in 'logit_bias': abc"),
        ({"logit_bias": {"-3": 1}}, "logit_bias", "non-negative integers"),
        ({"logit_bias": {"5": "up"}}, "logit_bias.5", "expected a decimal"),
        ({"logit_bias": [5, 10]}, "logit_bias", "expected an object"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "more than max_tokens (8)"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "Missing"),
        ({"stream": "yes"}, "stream", "expected a boolean"),
        ({"foo": 1}, "foo", "Unrecognized request argument supplied: foo"),
    ],
)
def test_chat_rejections(patch: dict[str, Any], param: str, fragment: str) -> None:
    body = {**CHAT, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    assert info.value.status == 400
    assert info.value.param == param
    assert fragment in info.value.message
    assert info.value.body()["error"]["type"] == "invalid_request_error"


def test_penalties_logit_bias_and_min_tokens() -> None:
    s = parse_chat_request(
        {
            **CHAT,
            "presence_penalty": 1.5,
            "frequency_penalty": -2,
            "repetition_penalty": 1.3,
            "logit_bias": {"50": -100, "7": 2.5, "007": 3},
            "min_tokens": 4,
        }
    ).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (1.5, -2.0, 1.3)
    assert s.logit_bias == ((7, 3.0), (50, -100.0))  # sorted; "007" is token 7 again
    assert s.min_tokens == 4
    defaults = parse_completion_request(COMPLETION).sampling
    assert (defaults.presence_penalty, defaults.frequency_penalty) == (0.0, 0.0)
    assert (defaults.repetition_penalty, defaults.logit_bias, defaults.min_tokens) == (1.0, (), 0)
    # The legacy endpoint's default max_tokens (16) bounds min_tokens too, once the
    # defaults are known (serving/token_budget.py; tests/router/test_defaults_and_limits.py).
    s = parse_completion_request({**COMPLETION, "min_tokens": 17}).sampling
    assert (s.max_tokens, s.min_tokens, "max_tokens" in s.unset) == (16, 17, True)


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    s = parse_chat_request({**CHAT, "logit_bias": {"3": 1, "99": 1}}).sampling
    check_logit_bias(s, 100)
    with pytest.raises(ApiError) as info:
        check_logit_bias(s, 99)
    assert info.value.status == 400 and info.value.param == "logit_bias"
    assert "token id 99 is outside the vocabulary (size 99)" in info.value.message


def test_body_must_be_an_object() -> None:
    for body in ([], "x", None, 3):
        with pytest.raises(ApiError, match="JSON object"):
            parse_chat_request(body)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ("hi",)),
        (["a", "b"], ("a", "b")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1], [2, 3]], ((1,), (2, 3))),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: tuple[Any, ...]) -> None:
    request = parse_completion_request({**COMPLETION, "prompt": prompt})
    assert request.prompts == expected
    assert request.sampling.max_tokens == 16  # OpenAI's default for this endpoint


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"messages": []}, "messages"),
    ],
)
def test_completion_rejections(patch: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_completion_request({**COMPLETION, **patch})
    assert info.value.status == 400 and info.value.param == param


def test_completion_logprobs_and_echo() -> None:
    request = parse_completion_request(
        {**COMPLETION, "logprobs": 3, "echo": False, "best_of": 2, "n": 2}
    )
    assert request.sampling.logprobs and request.sampling.top_logprobs == 3
    assert parse_completion_request({**COMPLETION, "logprobs": 0}).sampling.logprobs
    assert parse_completion_request({**COMPLETION, "echo": True}).echo


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (None, StreamOptions(False, False)),
        ({"include_usage": True}, StreamOptions(True, False)),
        ({"include_usage": True, "continuous_usage_stats": True}, StreamOptions(True, True)),
        # vLLM's meaning: per-chunk usage only when usage is asked for at all.
        ({"continuous_usage_stats": True}, StreamOptions(False, False)),
    ],
)
def test_stream_options(options: dict[str, bool] | None, expected: StreamOptions) -> None:
    body = {**CHAT, "stream": True, **({"stream_options": options} if options else {})}
    assert parse_chat_request(body).stream_options == expected


def test_vllm_extensions_keep_vllms_defaults_and_meaning() -> None:
    plain = parse_chat_request(CHAT)
    assert plain.add_generation_prompt and plain.chat_template_kwargs == {}
    assert plain.sampling.skip_special_tokens and not plain.sampling.include_stop_str_in_output
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": False, "skip_special_tokens": False,
            "include_stop_str_in_output": True}  # fmt: skip
    request = parse_chat_request(body)
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert not request.add_generation_prompt and not request.sampling.skip_special_tokens
    assert request.sampling.include_stop_str_in_output
    completion = parse_completion_request({**COMPLETION, "include_stop_str_in_output": True})
    assert completion.sampling.include_stop_str_in_output
