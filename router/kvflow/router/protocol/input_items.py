"""A stored Response's input items (``GET /v1/responses/{id}/input_items``). Pure.

``input_items`` turns the ``input`` a request gave (already checked by
``responses_api.chat_request``) into OpenAI's item objects, each with an id: a message's
text parts, a function call, a function call's output, in the order given. A string input
is one user message. An item that came with an ``id`` keeps it; the others are named after
the Response (``msg_<key>_in<i>`` for the Response ``resp_<key>``), so ids are unique
within a Response and the same on every read. What a listing returns of them is
``item_page``: OpenAI's cursor page (``limit`` 1-100, default 20; ``order`` ``desc``, the
default, or ``asc``; ``after`` an item id).

Only this Response's own input is listed, not the earlier turns that
``previous_response_id`` put before it: those are the input items of the responses that
answered them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvflow.router.protocol.errors import invalid_request, unsupported_parameter
from kvflow.router.protocol.responses_api import LOGPROBS_INCLUDE

DEFAULT_LIMIT = 20
MAX_LIMIT = 100
# Item kinds and the prefix of the ids kvflow gives them.
_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(raw_input: object, response_id: str) -> list[dict[str, Any]]:
    """The items of ``raw_input`` (a checked ``input``) for the Response ``response_id``."""
    key = response_id.removeprefix("resp_")
    given = [{"role": "user", "content": raw_input}] if isinstance(raw_input, str) else raw_input
    assert isinstance(given, list), "input is checked before it is stored"
    items = []
    for i, raw in enumerate(given):
        kind = raw.get("type", "message" if "role" in raw else None)
        item_id = raw.get("id")
        if not isinstance(item_id, str) or not item_id:
            item_id = f"{_ID_PREFIX[kind]}_{key}_in{i}"
        if kind == "message":
            item = {"id": item_id, "type": "message", "role": raw["role"],
                    "content": _parts(raw["role"], raw["content"])}  # fmt: skip
        elif kind == "function_call":
            item = {"id": item_id, "type": "function_call", "call_id": raw["call_id"],
                    "name": raw["name"], "arguments": raw["arguments"]}  # fmt: skip
        else:
            item = {"id": item_id, "type": "function_call_output", "call_id": raw["call_id"],
                    "output": raw["output"]}  # fmt: skip
        items.append({**item, "status": "completed"})
    return items


def _parts(role: str, content: object) -> list[dict[str, Any]]:
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        return [{"type": kind, "text": content}]
    assert isinstance(content, list)
    return [{"type": part["type"], "text": part["text"]} for part in content]


def item_page(
    items: Sequence[dict[str, Any]], query: Mapping[str, Sequence[str]]
) -> dict[str, Any]:
    """The list object a listing with ``query`` (each parameter's values) returns; a 400
    naming the parameter for a value it cannot take."""
    limit = _limit(query.get("limit", ()))
    order = _one(query.get("order", ()), "order") or "desc"
    if order not in ("asc", "desc"):
        raise invalid_request(f"Invalid 'order': expected 'asc' or 'desc', got {order!r}.",
                              param="order")  # fmt: skip
    for value in [*query.get("include", ()), *query.get("include[]", ())]:
        if value != LOGPROBS_INCLUDE:
            raise unsupported_parameter("include", f"value {value!r} is not supported by "
                                        f"kvflow (only {LOGPROBS_INCLUDE!r})")  # fmt: skip
    ordered = list(items) if order == "asc" else list(reversed(items))
    after = _one(query.get("after", ()), "after")
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise invalid_request(f"Invalid 'after': no input item '{after}' in this response.",
                                  param="after")  # fmt: skip
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return {"object": "list", "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(ordered) > limit}  # fmt: skip


def _one(values: Sequence[str], name: str) -> str | None:
    if len(values) > 1:
        raise invalid_request(f"Invalid '{name}': given {len(values)} times.", param=name)
    return values[0] if values else None


def _limit(values: Sequence[str]) -> int:
    text = _one(values, "limit")
    if text is None:
        return DEFAULT_LIMIT
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise invalid_request(f"Invalid 'limit': expected an integer from 1 to {MAX_LIMIT}, "
                              f"got {text!r}.", param="limit")  # fmt: skip
    return limit
