"""Chat messages: roles, text content and content parts, tool calls and tool results,
validated. Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type
from kvflow.router.protocol.limits import DEFAULT_LIMITS, RequestLimits, check_count

_CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made earlier in the conversation (sent back by the client)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_template_dict(self) -> dict[str, Any]:
        # Templates (Qwen, Llama 3.1, Hermes) write `arguments | tojson`: give them the
        # object; text that is not a JSON object stays text.
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _message_content(value: object, index: int, *, may_be_null: bool) -> str:
    param = f"messages[{index}].content"
    if value is None:
        # OpenAI's rule: only an assistant message that carries tool calls may leave its
        # content out. A null user message used to render as an empty turn, and the model
        # then answered nothing in particular until the context was full.
        if not may_be_null:
            raise invalid_request(
                f"Invalid value for '{param}': expected a string or an array of content "
                "parts, but got null instead. Only an assistant message with 'tool_calls' "
                "may have null content.",
                param=param,
                code="invalid_type",
            )
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid_type(param, "a string or an array of content parts", value)
    texts = []
    for j, part in enumerate(value):
        part_map = as_mapping(part, f"{param}[{j}]")
        kind = part_map.get("type")
        if kind != "text":
            raise unsupported_parameter(
                f"{param}[{j}].type", f"'{kind}' is not supported: this model reads text only"
            )
        text = part_map.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{param}[{j}].text", "a string", text)
        texts.append(text)
    return "".join(texts)


def _tool_calls(value: object, index: int) -> tuple[ToolCall, ...]:
    param = f"messages[{index}].tool_calls"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_type(param, "an array", value)
    calls = []
    for j, raw in enumerate(value):
        call = as_mapping(raw, f"{param}[{j}]")
        if call.get("type", "function") != "function":
            raise unsupported_parameter(f"{param}[{j}].type", "only 'function' is supported")
        fn = as_mapping(call.get("function"), f"{param}[{j}].function")
        call_id, name, arguments = call.get("id"), fn.get("name"), fn.get("arguments")
        for field_name, field_value in (("id", call_id), ("function.name", name),
                                        ("function.arguments", arguments)):  # fmt: skip
            if not isinstance(field_value, str):
                raise invalid_type(f"{param}[{j}].{field_name}", "a string", field_value)
        assert isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def parse_messages(
    fields: Fields, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[ChatMessage, ...]:
    value = fields.required("messages")
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise invalid_request(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
        )
    # Each message is rendered by the chat template and tokenized: the count bounds that.
    check_count("messages", "messages", len(value), "max_messages", limits)
    messages = []
    for i, raw in enumerate(value):
        message = as_mapping(raw, f"messages[{i}]")
        role = message.get("role")
        if role == "function":
            raise unsupported_parameter(
                f"messages[{i}].role", "'function' is deprecated: use 'tool' messages"
            )
        if not isinstance(role, str) or role not in _CHAT_ROLES:
            raise invalid_request(
                f"Invalid 'messages[{i}].role': expected one of {sorted(_CHAT_ROLES)}, "
                f"got {role!r}.",
                param=f"messages[{i}].role",
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid_type(f"messages[{i}].name", "a string", name)
        tool_calls = _tool_calls(message.get("tool_calls"), i)
        if tool_calls and role != "assistant":
            raise invalid_request(
                f"Invalid 'messages[{i}].tool_calls': only assistant messages have tool calls.",
                param=f"messages[{i}].tool_calls",
            )
        tool_call_id = message.get("tool_call_id")
        # A tool message needs one; on any other message one that is not a string is a
        # 400 too (the schema's type), though its value is ignored there.
        is_required = role == "tool"
        if (is_required or tool_call_id is not None) and not isinstance(tool_call_id, str):
            raise invalid_type(f"messages[{i}].tool_call_id", "a string", tool_call_id)
        # Templates know "system"; OpenAI's newer "developer" role means the same here.
        messages.append(
            ChatMessage(
                role="system" if role == "developer" else str(role),
                content=_message_content(
                    message.get("content"), i, may_be_null=role == "assistant" and bool(tool_calls)
                ),
                name=name,
                tool_calls=tool_calls,
                tool_call_id=tool_call_id if role == "tool" else None,
            )
        )
    return tuple(messages)
