"""The Responses API (``POST /v1/responses``) in chat completions' terms, both ways. Pure.

A Responses request says what a chat request says in other words: ``input`` (a string, or
messages, function calls and their outputs) and ``instructions`` are the ``messages``,
``max_output_tokens`` is ``max_tokens``, ``text.format`` is ``response_format``, and a
function tool is the chat's function tool flattened. So ``chat_request`` turns one into the
other, the gateway answers it on the chat path (quotas, routing, caches, tool calls and
structured output as for any chat request), and ``response_object`` and ``ResponseEvents``
turn the chat answer, whole or streamed, into a Response and its events.

A stored response (``store``, the default) keeps its conversation, so that a request with
``previous_response_id`` continues it: ``continued`` puts that history before the
request's input, and ``conversation`` is what the new response leaves for the next one
(api/response_store.py keeps them). What kvflow lacks (``conversation`` objects,
``background``, hosted tools, images) is refused with a 400 that says so. Only function
tools run (the chat path's tools).
"""

from __future__ import annotations

import json
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


def chat_request(body: object) -> tuple[dict[str, Any], ResponseEcho]:
    """The chat completions body that asks what ``body`` asks, and what the Response
    repeats of it; a 400 naming the Responses parameter for what cannot be asked."""
    fields = Fields(body)
    passed = {k: fields.raw(k) for k in _PASSED}
    chat: dict[str, Any] = {k: v for k, v in passed.items() if v is not None}
    fields.string("model", required=True)
    instructions = fields.string("instructions")
    input_messages = _messages(fields.required("input"))
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


# -- the answer ------------------------------------------------------------------------------


def response_object(chat: Mapping[str, Any], echo: ResponseEcho) -> dict[str, Any]:
    """The Response for a whole chat completion (one choice)."""
    events = ResponseEvents(echo)
    events.begin(chat)
    choice = chat["choices"][0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        item = _message_item(events.message_id, message.get("content") or "", "completed")
        item["content"][0]["logprobs"] = _logprobs(choice.get("logprobs"))
        events.output.append(item)
    for i, call in enumerate(calls):
        events.output.append(_call_item(f"fc_{events.key}_{i}", call, "completed"))
    return events.response(_status(choice.get("finish_reason")), chat.get("usage"))


def _status(finish_reason: object) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}  # fmt: skip


def _call_item(item_id: str, call: Mapping[str, Any], status: str) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"type": "function_call", "id": item_id, "call_id": call.get("id", ""),
            "name": function.get("name", ""), "arguments": function.get("arguments", ""),
            "status": status}  # fmt: skip


def _logprobs(chat_logprobs: Mapping[str, Any] | None) -> list[Any]:
    """The chat's ``logprobs.content`` (token, logprob, bytes, top_logprobs): the same
    entries output_text carries."""
    return list((chat_logprobs or {}).get("content") or [])


def _usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": chat_usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage.get("total_tokens", 0),
    }


class ResponseEvents:
    """A streamed chat completion's chunks, as the Response's events (OpenAI's order:
    created, in_progress, each output item added, its deltas, done, then completed or
    incomplete; a failure mid-stream is an ``error`` event and ``response.failed``). Each
    event is a dict with its ``type`` and ``sequence_number``; ``sse`` frames one."""

    def __init__(self, echo: ResponseEcho) -> None:
        self.echo = echo
        self.output: list[dict[str, Any]] = []  # the items as they stand, in output order
        self.key = ""  # the chat completion's id past its prefix: the Response's and items'
        self._chat: Mapping[str, Any] = {}
        self._seq = 0
        self._text_at: int | None = None  # the open message item's place in ``output``
        self._text: list[str] = []
        self._text_logprobs: list[Any] = []
        self._calls: dict[int, int] = {}  # chat tool call index -> its place in ``output``
        self._call_at: int | None = None  # the open function call item's place
        self._finish: object = None
        self._usage: Mapping[str, Any] | None = None

    @property
    def message_id(self) -> str:
        return f"msg_{self.key}"

    def begin(self, chat: Mapping[str, Any]) -> None:
        self._chat = chat
        self.key = str(chat.get("id", "")).partition("-")[2]

    def response(
        self, status: tuple[str, dict[str, str] | None], chat_usage: Mapping[str, Any] | None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        e = self.echo
        return {
            "id": f"resp_{self.key}",
            "object": "response",
            "created_at": self._chat.get("created", 0),
            "status": status[0],
            "error": error,
            "incomplete_details": status[1],
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "model": self._chat.get("model", ""),
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": e.store,
            "temperature": e.temperature,
            "text": e.text,
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": _usage(chat_usage),
            "user": e.user,
            "metadata": e.metadata,
            "prompt_cache_key": e.prompt_cache_key,
            "safety_identifier": e.safety_identifier,
        }

    def chunk(self, chunk: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The events one chat chunk (or a mid-stream ``{"error": ...}``) makes."""
        if "error" in chunk:
            return self._failed(as_mapping(chunk["error"], "error"))
        out: list[dict[str, Any]] = []
        if not self._chat:
            self.begin(chunk)
            progress = self.response(("in_progress", None), None)
            out += [self._event("response.created", response=progress),
                    self._event("response.in_progress", response=progress)]  # fmt: skip
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"], _logprobs(choice.get("logprobs")))
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
        return out

    def end(self) -> list[dict[str, Any]]:
        """The stream ended: the open items done, then the Response completed or
        incomplete (a stream that ended with no chunk at all: nothing)."""
        if not self._chat:
            return []
        out = self._close_text() + self._close_call()
        if not self.output:  # an empty answer is an empty message, as when collected
            out += self._open_text()
            out += self._close_text()
        status = _status(self._finish)
        kind = "response.completed" if status[0] == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self.response(status, self._usage))]

    def _failed(self, error: Mapping[str, Any]) -> list[dict[str, Any]]:
        message = str(error.get("message") or "The gateway failed on this request.")
        code = error.get("code")
        kind = "rate_limit_exceeded" if code == "rate_limit_exceeded" else "server_error"
        failed = self.response(("failed", None), self._usage, {"code": kind, "message": message})
        return [self._event("error", code=code, message=message, param=error.get("param")),
                self._event("response.failed", response=failed)]  # fmt: skip

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _open_text(self) -> list[dict[str, Any]]:
        item = _message_item(self.message_id, "", "in_progress")
        item["content"] = []
        self._text_at = at = len(self.output)
        self._text = []
        self._text_logprobs = []
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=at, item=dict(item)),
                self._event("response.content_part.added", item_id=item["id"],
                            output_index=at, content_index=0, part=part)]  # fmt: skip

    def _text_delta(self, text: str, logprobs: list[Any]) -> list[dict[str, Any]]:
        out = self._open_text() if self._text_at is None else []
        assert self._text_at is not None
        self._text.append(text)
        self._text_logprobs += logprobs
        return out + [self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=self._text_at, content_index=0, delta=text,
                                  logprobs=logprobs)]  # fmt: skip

    def _close_text(self) -> list[dict[str, Any]]:
        at = self._text_at
        if at is None:
            return []
        self._text_at = None
        text = "".join(self._text)
        done = self.output[at] = _message_item(self.message_id, text, "completed")
        done["content"][0]["logprobs"] = logprobs = self._text_logprobs
        return [self._event("response.output_text.done", item_id=done["id"], output_index=at,
                            content_index=0, text=text, logprobs=logprobs),
                self._event("response.content_part.done", item_id=done["id"], output_index=at,
                            content_index=0, part=done["content"][0]),
                self._event("response.output_item.done", output_index=at, item=done)]  # fmt: skip

    def _call_delta(self, call: Mapping[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        at = self._calls.get(index)
        if at is None:
            out += self._close_text() + self._close_call()  # the chat sends calls one by one
            opened = {"id": call.get("id", ""), "function": {"name": function.get("name", "")}}
            item = _call_item(f"fc_{self.key}_{index}", opened, "in_progress")
            self._calls[index] = self._call_at = at = len(self.output)
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=at,
                                   item=dict(item)))  # fmt: skip
        item = self.output[at]
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=at, delta=arguments))  # fmt: skip
        return out

    def _close_call(self) -> list[dict[str, Any]]:
        at = self._call_at
        if at is None:
            return []
        self._call_at = None
        item = self.output[at]
        item["status"] = "completed"
        done = self._event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=at, name=item["name"],
                           arguments=item["arguments"])  # fmt: skip
        return [done, self._event("response.output_item.done", output_index=at, item=dict(item))]


def sse(event: Mapping[str, Any]) -> bytes:
    """One event as the Responses API frames it: its type as the SSE event name."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
