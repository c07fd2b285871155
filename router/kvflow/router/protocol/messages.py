"""Chat messages: roles, text content and content parts, validated. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type

_CHAT_ROLES = {"system", "developer", "user", "assistant"}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        return message


def _message_content(value: object, index: int) -> str:
    param = f"messages[{index}].content"
    if value is None:
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


def parse_messages(fields: Fields) -> tuple[ChatMessage, ...]:
    value = fields.required("messages")
    if not isinstance(value, list):
        raise invalid_type("messages", "an array", value)
    if not value:
        raise invalid_request(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            param="messages",
        )
    messages = []
    for i, raw in enumerate(value):
        message = as_mapping(raw, f"messages[{i}]")
        role = message.get("role")
        if role in ("tool", "function") or message.get("tool_calls"):
            raise unsupported_parameter(f"messages[{i}].role", "tool calls are not supported")
        if role not in _CHAT_ROLES:
            raise invalid_request(
                f"Invalid 'messages[{i}].role': expected one of {sorted(_CHAT_ROLES)}, "
                f"got {role!r}.",
                param=f"messages[{i}].role",
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid_type(f"messages[{i}].name", "a string", name)
        # Templates know "system"; OpenAI's newer "developer" role means the same here.
        messages.append(
            ChatMessage(
                role="system" if role == "developer" else str(role),
                content=_message_content(message.get("content"), i),
                name=name,
            )
        )
    return tuple(messages)
