"""The Responses API (``POST /v1/responses``) in chat completions' terms, both ways. Pure.

A Responses request says what a chat request says in other words: ``input`` (a string, or
messages, function calls and their outputs) and ``instructions`` are the ``messages``,
``max_output_tokens`` is ``max_tokens``, ``text.format`` is ``response_format``, and a
function tool is the chat's function tool flattened. So ``chat_request`` turns one into the
other, the gateway answers it on the chat path (quotas, routing, caches, tool calls and
structured output as for any chat request), and protocol/response_events.py turns the
chat answer, whole or streamed, into a Response and its events.

A stored response (``store``, the default) keeps its conversation, so that a request with
``previous_response_id`` continues it: ``continued`` puts that history before the
request's input, and ``conversation`` is what the new response leaves for the next one
(api/response_store.py keeps them). What kvflow lacks (``conversation`` objects,
``background``, hosted tools, images) is refused with a 400 that says so. Only function
tools run (the chat path's tools).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow.router.protocol.errors import ApiError, invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type

# Passed to the chat request as they are (it checks them).
_PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "user",
           "safety_identifier", "prompt_cache_key", "service_tier", "priority_class")  # fmt: skip
LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20  # OpenAI's bound, the chat path's too
_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("user", "system", "developer", "assistant")
# A chat parameter's name in the chat path's errors, as the Responses API calls it.
_RENAMED = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


@dataclass(frozen=True)
class ResponseEcho:
    """What a Response repeats of its request (OpenAI's object carries these)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: Any = field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: Any = field(default_factory=dict)
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    previous_response_id: str | None = None
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id}
    # The chat messages of this request's own input (instructions apart).
    input_messages: list[dict[str, Any]] = field(default_factory=list)
    # That input as given, checked (protocol/input_items.py lists it).
    input: Any = ""


def chat_request(body: object) -> tuple[dict[str, Any], ResponseEcho]:
    """The chat completions body that asks what ``body`` asks, and what the Response
    repeats of it; a 400 naming the Responses parameter for what cannot be asked."""
    fields = Fields(body)
    passed = {k: fields.raw(k) for k in _PASSED}
    chat: dict[str, Any] = {k: v for k, v in passed.items() if v is not None}
    fields.string("model", required=True)
    instructions = fields.string("instructions")
    raw_input = fields.required("input")
    input_messages = _messages(raw_input)
    chat["messages"] = _instructed(instructions, input_messages)
    max_output_tokens = fields.integer("max_output_tokens", low=1)
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    _stream_options(fields.raw("stream_options"), chat.get("stream") is True)
    if chat.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}  # the usage response.completed carries
    tools = fields.raw("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    tool_choice = fields.raw("tool_choice")
    if tool_choice is not None:
        chat["tool_choice"] = _tool_choice(tool_choice)
    text = fields.raw("text")
    if text is not None:
        response_format = _response_format(text)
        if response_format is not None:
            chat["response_format"] = response_format
    metadata = fields.raw("metadata")
    if metadata is not None:
        as_mapping(metadata, "metadata")
    store = fields.boolean("store", True)
    previous_response_id = fields.string("previous_response_id")
    if previous_response_id == "":
        raise invalid_request("Invalid 'previous_response_id': empty string.",
                              param="previous_response_id")  # fmt: skip
    fields.reject_if_set("conversation", "is not supported: chain responses with "
                         "'previous_response_id', or send the conversation in 'input'")  # fmt: skip
    fields.reject_if_set("background", "is not supported: kvflow answers while you wait "
                         "(stream for the tokens as they come)", allowed=(False,))  # fmt: skip
    fields.reject_if_set("truncation", "supports only 'disabled': a prompt over the model's "
                         "context is a 400, never cut", allowed=("disabled",))  # fmt: skip
    fields.reject_if_set("reasoning", "is not supported by this model",
                         allowed=({"effort": None}, {"effort": None, "summary": None}))  # fmt: skip
    top_logprobs = fields.integer("top_logprobs", low=0, high=MAX_TOP_LOGPROBS)
    if _includes_logprobs(fields.raw("include")):
        chat["logprobs"] = True
        if top_logprobs:
            chat["top_logprobs"] = top_logprobs
    for name in ("prompt", "max_tool_calls", "context_management"):
        fields.reject_if_set(name, "is not supported by kvflow's Responses API")
    fields.reject_unknown()
    echo = ResponseEcho(
        instructions=instructions,
        max_output_tokens=max_output_tokens,
        temperature=chat.get("temperature"),
        top_p=chat.get("top_p"),
        tools=list(tools or []),
        tool_choice=tool_choice if tool_choice is not None else "auto",
        parallel_tool_calls=chat.get("parallel_tool_calls", True),
        text=text if text is not None else {"format": {"type": "text"}},
        metadata=metadata if metadata is not None else {},
        user=chat.get("user"),
        prompt_cache_key=chat.get("prompt_cache_key"),
        safety_identifier=chat.get("safety_identifier"),
        previous_response_id=previous_response_id,
        store=store,
        input_messages=input_messages,
        input=raw_input,
    )
    return chat, echo


def continued(chat: dict[str, Any], echo: ResponseEcho, history: list[Any]) -> dict[str, Any]:
    """``chat`` after ``history``, the conversation of the response it continues (its
    instructions are not carried over: this request's own are, as OpenAI does)."""
    return {**chat, "messages": _instructed(echo.instructions, [*history, *echo.input_messages])}


def conversation(echo: ResponseEcho, history: list[Any], response: Mapping[str, Any]) -> list[Any]:
    """What a response continuing this one sees before its input: ``history``, this
    request's input, and this response's output as the assistant's turn."""
    out: list[Any] = [*history, *echo.input_messages]
    calls = []
    for item in response.get("output") or ():
        if item.get("type") == "message":
            text = "".join(part.get("text", "") for part in item.get("content") or ())
            out.append({"role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            function = {"name": item["name"], "arguments": item["arguments"]}
            calls.append({"id": item["call_id"], "type": "function", "function": function})
    if calls:
        out.append({"role": "assistant", "content": None, "tool_calls": calls})
    return out


def _instructed(instructions: str | None, messages: list[Any]) -> list[Any]:
    return [{"role": "system", "content": instructions}, *messages] if instructions else messages


def renamed(error: ApiError) -> ApiError:
    """A chat path's 400 with the parameter named as the Responses API names it."""
    param = error.param
    if param is None:
        return error
    head, sep, rest = param.partition("[")
    head, dot, tail = head.partition(".")
    new = _RENAMED.get(head)
    if new is None:
        return error
    if new == "input":  # messages are not input items one for one: name the whole input
        error.param = "input"
    else:
        error.param = new + dot + tail + sep + rest
    error.message = error.message.replace(f"'{param}'", f"'{error.param}'")
    if head == "max_tokens":  # the context-length error says "reduce max_tokens"
        error.message = error.message.replace("max_tokens", "max_output_tokens")
    return error


# -- the request -----------------------------------------------------------------------------


def _messages(value: object) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid_type("input", "a string or an array of input items", value)
    if not value:
        raise invalid_request("Invalid 'input': empty array. Expected at least one item.",
                              param="input")  # fmt: skip
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        item = as_mapping(raw, where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where),
                                 "arguments": _text(item, "arguments", where)}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(
                    _part_text(p, f"{where}.output[{j}]") for j, p in enumerate(output)
                )
            if not isinstance(output, str):
                raise invalid_type(f"{where}.output", "a string", output)
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                             "content": output})  # fmt: skip
        elif kind == "item_reference":
            raise unsupported_parameter(f"{where}.type", "is not supported: continue a stored "
                                        "response with 'previous_response_id'")  # fmt: skip
        else:
            raise invalid_request(
                f"Invalid '{where}.type': {kind!r} is not an input item kvflow takes: use "
                "'message', 'function_call' or 'function_call_output'.",
                param=f"{where}.type",
            )
    return messages


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise invalid_request(f"Invalid '{where}.role': expected one of {', '.join(_ROLES)}, "
                              f"but got {role!r} instead.", param=f"{where}.role")  # fmt: skip
    content = item.get("content")
    if isinstance(content, list):
        content = [{"type": "text", "text": _part_text(p, f"{where}.content[{j}]")}
                   for j, p in enumerate(content)]  # fmt: skip
    elif not isinstance(content, str):
        raise invalid_type(f"{where}.content", "a string or an array of content parts", content)
    return {"role": role, "content": content}


def _part_text(part: object, where: str) -> str:
    part = as_mapping(part, where)
    kind = part.get("type")
    if kind not in _TEXT_PARTS:
        raise unsupported_parameter(
            f"{where}.type", f"{kind!r} is not supported: this model reads text only "
            "('input_text')",
        )  # fmt: skip
    return _text(part, "text", where)


def _text(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid_type(f"{where}.{name}", "a string", value)
    return value


def _includes_logprobs(value: object) -> bool:
    """``include``: only ``message.output_text.logprobs`` (each output_text's tokens with
    their log probabilities, and ``top_logprobs`` alternatives) is something kvflow has."""
    if value is None:
        return False
    if not isinstance(value, list):
        raise invalid_type("include", "an array", value)
    for i, name in enumerate(value):
        if name != LOGPROBS_INCLUDE:
            raise unsupported_parameter(f"include[{i}]", f"{name!r} is not supported: kvflow "
                                        f"can include only '{LOGPROBS_INCLUDE}'")  # fmt: skip
    return bool(value)


def _stream_options(value: object, stream: bool) -> None:
    """Only ``include_obfuscation``, and only with ``stream: true``. kvflow sends no
    obfuscation padding either way: its events carry no field for it."""
    if value is None:
        return
    options = as_mapping(value, "stream_options")
    if not stream:
        raise invalid_request("'stream_options' is only allowed when 'stream' is true.",
                              param="stream_options")  # fmt: skip
    for name, setting in options.items():
        if name != "include_obfuscation":
            where = f"stream_options.{name}"
            raise invalid_request(f"Unrecognized request argument supplied: {where}",
                                  param=where, code="unknown_parameter")  # fmt: skip
        if not isinstance(setting, bool):
            raise invalid_type("stream_options.include_obfuscation", "a boolean", setting)


def _tools(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_type("tools", "an array", value)
    out = []
    for i, raw in enumerate(value):
        tool = as_mapping(raw, f"tools[{i}]")
        if tool.get("type") != "function":
            raise unsupported_parameter(
                f"tools[{i}].type", f"{tool.get('type')!r} is not supported: kvflow runs "
                "'function' tools, which your code executes",
            )  # fmt: skip
        spec = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": spec})
    return out


def _tool_choice(value: object) -> object:
    if isinstance(value, str):
        return value  # auto, none, required: the chat's own words
    choice = as_mapping(value, "tool_choice")
    if choice.get("type") != "function":
        raise unsupported_parameter("tool_choice", "supports 'auto', 'none', 'required' and "
                                    "{'type': 'function', 'name': ...}")  # fmt: skip
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(value: object) -> dict[str, Any] | None:
    text = as_mapping(value, "text")
    if text.get("verbosity") is not None:
        raise unsupported_parameter("text.verbosity", "is not supported by this model")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        name = f"text.{sorted(unknown)[0]}"
        raise invalid_request(f"Unrecognized request argument supplied: {name}", param=name,
                              code="unknown_parameter")  # fmt: skip
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = as_mapping(fmt, "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid_request(f"Invalid 'text.format.type': expected 'text', 'json_object' or "
                          f"'json_schema', but got {kind!r} instead.",
                          param="text.format.type")  # fmt: skip
