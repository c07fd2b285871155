"""Tools into the prompt, through the model's chat template when it knows tools.

A template that reads ``tools`` (Qwen2.5, Llama 3.1, Hermes, Mistral) gets them, and the
conversation's tool calls and tool results, in Hugging Face's shapes, and writes them in
the format its model was trained on. A template that does not (SmolLM2's) gets kvflow's
own Hermes-style instructions in the system message, earlier calls written back as
``<tool_call>`` blocks and tool results as ``<tool_response>`` blocks in a user turn; the
Hermes parser reads the answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvflow.router.protocol.messages import ChatMessage
from kvflow.router.tools.parsers import HERMES_CLOSE, HERMES_OPEN
from kvflow.router.tools.spec import ToolChoice, ToolSpec

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def template_knows_tools(template_source: str | None) -> bool:
    return template_source is not None and "tools" in template_source


def tool_instructions(tools: Sequence[ToolSpec], choice: ToolChoice) -> str:
    lines = [
        "You can call functions to help answer. Their signatures, as JSON Schema:",
        "<tools>",
        *(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools),
        "</tools>",
        "To call a function, answer with one block per call, each exactly:",
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{HERMES_CLOSE}",
    ]
    if choice.mode == "required":
        lines.append("You must call at least one function.")
    elif choice.mode == "named":
        lines.append(f"You must call the function {choice.name}.")
    return "\n".join(lines)


def _written_calls(message: ChatMessage) -> str:
    blocks = [
        f"{HERMES_OPEN}\n"
        + json.dumps(
            {"name": c.name, "arguments": c.as_template_dict()["function"]["arguments"]},
            ensure_ascii=False,
        )
        + f"\n{HERMES_CLOSE}"
        for c in message.tool_calls
    ]
    return "\n".join([message.content, *blocks] if message.content else blocks)


def prepare_tool_prompt(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec],
    choice: ToolChoice,
    template_source: str | None,
) -> tuple[list[ChatMessage], dict[str, Any]]:
    """The messages to render and the template variables to add (``tools``)."""
    offer_tools = bool(tools) and choice.mode != "none"
    if template_knows_tools(template_source):
        extra = {"tools": [t.as_openai() for t in tools]} if offer_tools else {}
        return list(messages), extra
    out: list[ChatMessage] = []
    for m in messages:
        if m.role == "tool":
            out.append(ChatMessage("user", f"{TOOL_RESPONSE_OPEN}\n{m.content}\n"
                                   f"{TOOL_RESPONSE_CLOSE}"))  # fmt: skip
        elif m.tool_calls:
            out.append(ChatMessage("assistant", _written_calls(m), m.name))
        else:
            out.append(m)
    if offer_tools:
        instructions = tool_instructions(tools, choice)
        if out and out[0].role == "system":
            out[0] = replace(out[0], content=f"{out[0].content}\n\n{instructions}")
        else:
            out.insert(0, ChatMessage("system", instructions))
    return out, {}
