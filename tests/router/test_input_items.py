"""A stored Response's input items (protocol/input_items.py): the input as OpenAI's items
with ids, and the cursor page a listing returns, with a 400 naming each bad parameter."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from kvflow.router.api.openapi_responses import INPUT_ITEM_LIST
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.input_items import input_items, item_page
from kvflow.router.protocol.responses_api import LOGPROBS_INCLUDE, chat_request

TURNS: list[Any] = [
    {"role": "system", "content": "Be brief."},
    {"type": "message", "role": "user", "id": "msg_mine",
     "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\":\"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
    {"role": "assistant", "content": "It is 18 C."},
]  # fmt: skip


def _items(raw: object) -> list[dict[str, Any]]:
    _, echo = chat_request({"model": "m", "input": raw})  # checked as a request checks it
    return input_items(echo.input, "resp_abc")


def test_a_string_input_is_one_user_message() -> None:
    assert _items("hi") == [{"id": "msg_abc_in0", "type": "message", "role": "user",
                             "content": [{"type": "input_text", "text": "hi"}],
                             "status": "completed"}]  # fmt: skip


def test_items_keep_their_order_kinds_and_given_ids() -> None:
    items = _items(TURNS)
    assert [i["id"] for i in items] == ["msg_abc_in0", "msg_mine", "fc_abc_in2", "fco_abc_in3",
                                        "msg_abc_in4"]  # fmt: skip
    assert [i["type"] for i in items] == ["message", "message", "function_call",
                                          "function_call_output", "message"]  # fmt: skip
    assert items[0]["content"] == [{"type": "input_text", "text": "Be brief."}]
    assert items[2]["arguments"] == '{"city":"Paris"}' and items[2]["name"] == "get_weather"
    assert items[3]["output"] == "18 C" and items[3]["call_id"] == "call_1"
    assert items[4]["content"] == [{"type": "output_text", "text": "It is 18 C."}]
    assert {i["status"] for i in items} == {"completed"}


def test_a_page_is_newest_first_by_default_and_pages_with_after() -> None:
    items = _items(TURNS)
    ids = [i["id"] for i in items]
    page = item_page(items, {})
    assert [i["id"] for i in page["data"]] == ids[::-1] and page["has_more"] is False
    assert (page["first_id"], page["last_id"]) == (ids[-1], ids[0])
    seen, after = [], None
    while True:
        query = {"limit": ["2"], "order": ["asc"], **({"after": [after]} if after else {})}
        page = item_page(items, query)
        seen += [i["id"] for i in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert seen == ids
    assert item_page(items, {"after": [ids[0]]})["data"] == []  # the oldest, newest first
    empty = item_page([], {})
    assert empty["data"] == [] and empty["first_id"] is None and empty["has_more"] is False
    assert item_page(items, {"include": [LOGPROBS_INCLUDE]}) == item_page(items, {})


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": ["0"]}, "limit"), ({"limit": ["101"]}, "limit"), ({"limit": ["x"]}, "limit"),
     ({"limit": ["1", "2"]}, "limit"), ({"order": ["up"]}, "order"),
     ({"after": ["msg_nowhere"]}, "after"), ({"include": ["reasoning.encrypted_content"]},
                                             "include")],
)  # fmt: skip
def test_a_bad_parameter_is_a_400_naming_it(query: dict[str, list[str]], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        item_page(_items(TURNS), query)
    assert caught.value.status == 400 and caught.value.param == param


def test_a_page_is_what_the_openapi_document_says() -> None:
    validator = jsonschema.Draft202012Validator(INPUT_ITEM_LIST)
    for raw in (TURNS, "hi", [{"type": "function_call_output", "call_id": "c",
                               "output": [{"type": "input_text", "text": "18 C"}]}]):  # fmt: skip
        validator.validate(item_page(_items(raw), {}))
        validator.validate(item_page(_items(raw), {"limit": ["1"], "order": ["asc"]}))
