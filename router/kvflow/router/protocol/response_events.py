"""A chat completion as the Responses API's answer (protocol/responses_api.py is the
request): ``response_object`` for a whole one, ``ResponseEvents`` for a stream's chunks,
in OpenAI's event order, and ``sse`` to frame an event. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvflow.router.protocol.fields import as_mapping
from kvflow.router.protocol.responses_api import ResponseEcho


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
