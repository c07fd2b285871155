"""The files and batches listings' pages (batch/listing.py): newest first, ``limit`` a
page, ``after`` the cursor, ``has_more``, files' ``order`` and ``purpose``; a 400 naming the
parameter it cannot take."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvflow.router.batch.listing import BATCHES, FILES, page, page_query
from kvflow.router.protocol.errors import ApiError


@dataclass(frozen=True)
class Item:
    id: str
    created_s: int
    purpose: str = "batch"


ITEMS = [Item("f-a", 1), Item("f-b", 2), Item("f-c", 2, "batch_output"), Item("f-d", 3)]


def _ids(query: dict[str, list[str]]) -> tuple[list[str], bool]:
    found, more = page(
        ITEMS,
        page_query(query, FILES),
        id_of=lambda i: i.id,
        created_s_of=lambda i: i.created_s,
        purpose_of=lambda i: i.purpose,
    )
    return [i.id for i in found], more


def test_pages_walk_newest_first_by_the_cursor() -> None:
    assert _ids({"limit": ["2"]}) == (["f-d", "f-c"], True)
    assert _ids({"limit": ["2"], "after": ["f-c"]}) == (["f-b", "f-a"], False)
    assert _ids({}) == (["f-d", "f-c", "f-b", "f-a"], False)
    assert _ids({"order": ["asc"], "limit": ["3"]}) == (["f-a", "f-b", "f-c"], True)
    assert _ids({"purpose": ["batch_output"]}) == (["f-c"], False)


def test_batches_default_to_twenty_and_take_no_order() -> None:
    many = [Item(f"b-{i:03d}", i) for i in range(30)]
    query = page_query({"order": ["asc"]}, BATCHES)  # ignored, as OpenAI's batches list
    found, more = page(many, query, id_of=lambda i: i.id, created_s_of=lambda i: i.created_s)
    assert [i.id for i in found] == [f"b-{i:03d}" for i in range(29, 9, -1)] and more


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": ["0"]}, "limit"), ({"limit": ["10001"]}, "limit"), ({"limit": ["x"]}, "limit"),
     ({"order": ["up"]}, "order"), ({"after": ["f-gone"]}, "after"),
     ({"limit": ["1", "2"]}, "limit")],
)  # fmt: skip
def test_a_value_it_cannot_take_is_a_400_naming_it(query: dict[str, list[str]], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        _ids(query)
    assert refused.value.status == 400 and refused.value.body()["error"]["param"] == param


def test_batches_take_at_most_a_hundred() -> None:
    with pytest.raises(ApiError):
        page_query({"limit": ["101"]}, BATCHES)
