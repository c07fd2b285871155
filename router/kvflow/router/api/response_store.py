"""Stored Responses (``store``, the Responses API's default): each Response and the
conversation it ends, for ``previous_response_id`` and ``GET``/``DELETE
/v1/responses/{id}``. In Redis when the gateway has one (every router replica reads what
another stored), else in this replica's memory (past ``--responses-max-memory-bytes``
the tenant holding the most gives up its least recently used). Entries expire after
``--responses-ttl-s``, by default OpenAI's 30 days (api/response_store_config.py).

Keys carry the tenant's name, so a tenant finds only its own responses: another's id is
a 404, as an unknown one is. A failing Redis raises ``ResponseStoreError``: the caller
answers without storing, or 503 where it needed a stored response.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from redis.asyncio import Redis

from kvflow.router.api.response_store_config import DEFAULT_MAX_MEMORY_BYTES, DEFAULT_TTL_S
from kvflow.router.caches.stores import MemoryAnswerStore
from kvflow.router.store_errors import STORE_ERRORS

T = TypeVar("T")


class ResponseStoreError(Exception):
    """The store (Redis) did not answer, or could not keep the entry."""


async def _redis_call(call: Awaitable[T]) -> T:
    try:
        return await call
    except STORE_ERRORS as exc:
        raise ResponseStoreError(f"the response store (Redis) failed: {exc}") from exc


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object, as it was answered
    conversation: list[Any]  # chat messages up to and including its output
    # Its request's input as items (protocol/input_items.py); [] where stored before them.
    input_items: list[Any] = field(default_factory=list)


class ResponseStore:
    def __init__(
        self,
        redis: Redis | None,
        scope: str,
        ttl_s: float = DEFAULT_TTL_S,
        max_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
    ) -> None:
        self._redis = redis
        self._prefix = f"kvflow:responses:{scope}:"
        # In memory, one tenant's responses never push out another's while that one holds
        # less than its share (stores.py).
        self._memory = (
            MemoryAnswerStore(max_bytes, owner_of=self._tenant_of) if redis is None else None
        )
        self.ttl_s = ttl_s

    @property
    def is_shared(self) -> bool:
        """Whether other router replicas see what this one stores."""
        return self._redis is not None

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        entry = {"response": stored.response, "conversation": stored.conversation,
                 "input_items": stored.input_items}  # fmt: skip
        value = json.dumps(entry, separators=(",", ":")).encode()
        key = self._key(tenant, stored.response["id"])
        if self._redis is not None:
            await _redis_call(self._redis.set(key, value, px=max(1, int(self.ttl_s * 1000))))
        else:
            assert self._memory is not None
            if not self._memory.fits(key, value):
                # Said, not silent: the Response then answers "store": false, not a 404 on
                # its first read.
                raise ResponseStoreError(
                    f"the response and its conversation ({len(value)} bytes) are larger "
                    f"than this replica's memory for them (--responses-max-memory-bytes "
                    f"{self._memory.max_bytes})"
                )
            await self._memory.put(key, value, self.ttl_s)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = self._key(tenant, response_id)
        if self._redis is not None:
            value = await _redis_call(self._redis.get(key))
        else:
            assert self._memory is not None
            value = await self._memory.get(key)
        if value is None:
            return None
        entry = json.loads(value)
        return StoredResponse(entry["response"], entry["conversation"],
                              entry.get("input_items", []))  # fmt: skip

    async def delete(self, tenant: str, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        if self._redis is not None:
            return bool(await _redis_call(self._redis.unlink(key)))
        assert self._memory is not None
        return await self._memory.delete(key)

    def _tenant_of(self, key: str) -> str:
        return key.removeprefix(self._prefix).partition(":")[0]

    def _key(self, tenant: str, response_id: str) -> str:
        # Tenant names are checked to be plain (tenants/config.py); an id is the client's
        # string, kept whole after the last colon.
        return f"{self._prefix}{tenant}:{response_id}"
