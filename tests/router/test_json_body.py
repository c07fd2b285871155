"""The gateway's JSON bodies (``api/http.parse_json_body``): what ``json.loads`` takes that is
not JSON, or not text, is a 400 naming what is wrong, before any later stage sees it (the
tokenizer, protobuf and UTF-8 fail on a lone surrogate: it was a 500)."""

from __future__ import annotations

import json

import pytest

from kvflow.router.api.http import parse_json_body
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.strict_json import lone_surrogate_at


def refused(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_json_body(body)
    assert info.value.status == 400
    return info.value


def test_json_bodies_parse_as_json() -> None:
    value = {"model": "m", "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600 a\x00b"}]}
    assert parse_json_body(json.dumps(value).encode()) == value  # escaped: a surrogate pair
    assert parse_json_body(json.dumps(value, ensure_ascii=False).encode()) == value
    assert parse_json_body(json.dumps(value).encode("utf-16")) == value  # JSON allows UTF-16


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_are_not_json(constant: bytes) -> None:
    error = refused(b'{"model": "m", "temperature": ' + constant + b"}")
    assert f"{constant.decode().lstrip('-')} is not a JSON number" in error.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "\\uDC00"}]}', "messages[0].content"),
        (b'{"prompt": ["ok", "\\ude00\\ud83d"]}', "prompt[1]"),  # low then high: no pair
        (b'{"model": "m\\udbff"}', "model"),
        (b'{"tools": [{"function": {"description": "\\ud83d"}}]}', "tools[0].function.description"),
        (b'{"metadata": {"k\\ud800": 1}}', "metadata.k\\ud800"),  # a key
    ],
)
def test_a_lone_surrogate_escape_is_refused_where_it_is(body: bytes, param: str) -> None:
    error = refused(body)
    assert error.param == param
    assert "lone UTF-16 surrogate" in error.message
    json.dumps(error.body())  # the answer itself encodes


def test_raw_surrogates_are_not_utf8() -> None:
    # json.loads would decode these bytes (surrogatepass) into a lone surrogate
    error = refused(b'{"model": "m", "prompt": "a\xed\xa0\x80b"}')
    assert "could not parse the JSON body" in error.message


def test_the_walk_takes_any_depth_the_parser_does() -> None:
    deep: object = "\ud800"
    for _ in range(5000):
        deep = [deep]
    assert lone_surrogate_at({"a": deep}) == "a" + "[0]" * 5000
    assert lone_surrogate_at({"a": [1, None, {"b": "fine \U0001f600"}]}) is None
