"""Tool calls out of a model's text, per model family. Pure.

- ``hermes``: Hermes/Qwen-style blocks, ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, any number, text around them is content. Also what kvflow's own tool
  prompt asks for when the chat template has no tool support (SmolLM2).
- ``llama3_json``: Llama 3.x's JSON calls, ``{"name": ..., "parameters": {...}}`` as the
  whole answer (optionally after ``<|python_tag|>``), several separated by ``;``.

A block that does not parse as a call stays in the content: the client sees what the
model wrote rather than losing it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

ToolFamily = Literal["hermes", "llama3_json"]

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def family_of_template(template_source: str | None) -> ToolFamily:
    """The output format a chat template teaches; Hermes for templates without tools
    (kvflow's own tool prompt uses it)."""
    source = template_source or ""
    if HERMES_OPEN in source:
        return "hermes"
    if PYTHON_TAG in source or "ipython" in source:
        return "llama3_json"
    return "hermes"


def call_from_json(text: str, arguments_key: str = "arguments") -> ParsedCall | None:
    """``{"name": str, "arguments"|"parameters": object}`` -> a call; None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return call_from_value(value, arguments_key)


def call_from_value(value: Any, arguments_key: str = "arguments") -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    if not _is_utf8(value["name"]) or not _is_utf8(text):
        # A lone surrogate the model wrote as an escape ("\ud800"): no UTF-8 response can
        # carry it (a 500 before). Not a call: the text stays the answer's content.
        return None
    return ParsedCall(value["name"], text)


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def parse_llama3_json(text: str) -> list[ParsedCall] | None:
    """All calls of a Llama-3 JSON answer, or None when the text is not (only) calls."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    whole = call_from_json(body, "parameters")
    if whole is not None:
        return [whole]
    calls = [call_from_json(part.strip(), "parameters") for part in body.split(";")]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_forced_array(text: str) -> list[ParsedCall] | None:
    """The ``required`` grammar's output: ``[{"name": ..., "arguments": {...}}, ...]``."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    calls = [call_from_value(v) for v in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]
