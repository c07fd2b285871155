"""Stored Responses in this replica's memory (api/response_store.py) and their flags; the
Redis side runs in tests/gateway/test_responses_api.py, shared by two router processes."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from kvflow.router.api.response_store import ResponseStore, StoredResponse
from kvflow.router.api.response_store_config import (
    ResponseStoreConfig,
    add_response_store_flags,
    response_store_config,
)


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id, "object": "response"}, [{"role": "user"}])


def test_a_tenant_gets_deletes_only_its_own_and_only_the_exact_id() -> None:
    async def run() -> None:
        store = ResponseStore(None, "default")
        assert not store.is_shared
        await store.put("alice", _stored("resp_a"))
        await store.put("alice", _stored("resp_ab"))
        found = await store.get("alice", "resp_a")
        assert found == _stored("resp_a")
        assert await store.get("bob", "resp_a") is None  # another tenant's: not there
        assert not await store.delete("bob", "resp_a")
        assert await store.delete("alice", "resp_a")
        assert await store.get("alice", "resp_a") is None
        assert await store.get("alice", "resp_ab") is not None  # not a prefix delete
        assert not await store.delete("alice", "resp_a")

    asyncio.run(run())


def test_memory_keeps_the_most_recent_within_its_bytes() -> None:
    async def run() -> None:
        store = ResponseStore(None, "default", max_bytes=400)
        for i in range(10):
            await store.put("alice", _stored(f"resp_{i}"))
        assert await store.get("alice", "resp_9") is not None
        assert await store.get("alice", "resp_0") is None

    asyncio.run(run())


def test_an_entry_expires_after_the_stores_ttl() -> None:
    async def run() -> None:
        store = ResponseStore(None, "default", ttl_s=0.2)
        await store.put("alice", _stored("resp_a"))
        assert await store.get("alice", "resp_a") is not None
        await asyncio.sleep(0.3)
        assert await store.get("alice", "resp_a") is None

    asyncio.run(run())


def _flags(*argv: str) -> ResponseStoreConfig:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_response_store_flags(p)
    return response_store_config(p.parse_args(argv))


def test_the_flags_set_the_ttl_and_the_memory_bound() -> None:
    assert _flags() == ResponseStoreConfig(30 * 24 * 3600.0, 256 * 2**20)
    assert _flags("--responses-ttl-s", "3600", "--responses-max-memory-bytes", "1024") == (
        ResponseStoreConfig(3600.0, 1024)
    )
    for argv in (("--responses-ttl-s", "0"), ("--responses-ttl-s", "nan"),
                 ("--responses-max-memory-bytes", "0")):  # fmt: skip
        with pytest.raises(argparse.ArgumentError):
            _flags(*argv)
