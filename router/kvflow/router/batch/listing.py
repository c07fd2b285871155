"""`GET /v1/files` and `GET /v1/batches` as OpenAI pages them (pure): newest first, at most
``limit`` a page, ``after`` the last id of the page before, ``has_more`` when more follow.
The SDKs' ``list()`` walks the pages with ``after``; one page of everything would be
correct but unbounded (a tenant with many files made every listing read them all).

Files also take ``order`` (``desc``, the default, or ``asc``) and ``purpose``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvflow.router.protocol.errors import invalid_request

T = TypeVar("T")


@dataclass(frozen=True)
class PageRules:
    default_limit: int
    max_limit: int
    has_order: bool  # takes ``order``; else always newest first
    has_purpose: bool  # takes ``purpose``, a filter


FILES = PageRules(default_limit=10_000, max_limit=10_000, has_order=True, has_purpose=True)
BATCHES = PageRules(default_limit=20, max_limit=100, has_order=False, has_purpose=False)


@dataclass(frozen=True)
class PageQuery:
    limit: int
    is_ascending: bool
    after: str | None
    purpose: str | None


def page_query(query: Mapping[str, Sequence[str]], rules: PageRules) -> PageQuery:
    """The query's paging parameters; a 400 naming the one it cannot take."""
    limit_text = _one(query, "limit")
    limit = rules.default_limit
    if limit_text is not None:
        limit = int(limit_text) if limit_text.strip().isdigit() else 0
        if not 1 <= limit <= rules.max_limit:
            message = (f"Invalid 'limit': expected an integer from 1 to {rules.max_limit}, "
                       f"got {limit_text!r}.")  # fmt: skip
            raise invalid_request(message, param="limit")
    order = _one(query, "order") if rules.has_order else None
    if order not in (None, "asc", "desc"):
        raise invalid_request(f"Invalid 'order': expected 'asc' or 'desc', got {order!r}.",
                              param="order")  # fmt: skip
    purpose = _one(query, "purpose") if rules.has_purpose else None
    return PageQuery(limit, order == "asc", _one(query, "after"), purpose)


def page(
    items: Sequence[T],
    query: PageQuery,
    *,
    id_of: Callable[[T], str],
    created_s_of: Callable[[T], int],
    purpose_of: Callable[[T], str] | None = None,
) -> tuple[list[T], bool]:
    """The page's items and whether more follow. Ordered by creation time, then id (so a
    cursor is stable among items created in the same second)."""
    ordered = sorted(items, key=lambda item: (created_s_of(item), id_of(item)),
                     reverse=not query.is_ascending)  # fmt: skip
    if query.purpose is not None and purpose_of is not None:
        ordered = [item for item in ordered if purpose_of(item) == query.purpose]
    if query.after is not None:
        ids = [id_of(item) for item in ordered]
        if query.after not in ids:
            raise invalid_request(f"Invalid 'after': no '{query.after}' in this list (it may "
                                  "have been deleted); list again from the start.",
                                  param="after")  # fmt: skip
        ordered = ordered[ids.index(query.after) + 1 :]
    return ordered[: query.limit], len(ordered) > query.limit


def list_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}  # fmt: skip


def _one(query: Mapping[str, Sequence[str]], name: str) -> str | None:
    values = query.get(name, ())
    if len(values) > 1:
        raise invalid_request(f"Invalid '{name}': given {len(values)} times.", param=name)
    return values[0] if values else None
