"""Router configuration parsing, worker discovery (static and DNS), public prefix matching."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass, field

import pytest

from kvflow.router.routing.placement import DisaggregationConfig
from kvflow.router.serving.public_prefix import PublicPrefixes
from kvflow.router.settings import ConfigError, parse_config
from kvflow.router.tenants.config import TenantConfigError, hash_api_key
from kvflow.router.workers.discovery import (
    DiscoveryConfigError,
    DnsWorkers,
    parse_worker_list,
)


def test_config_defaults_and_overrides() -> None:
    default = parse_config(None)
    assert default.weights == {"time_cost": 1.0, "session": 0.01}
    assert default.tenants.is_open and default.max_body_bytes == 8 * 1024 * 1024
    config = parse_config(
        {
            "routing": {"weights": {"kv_usage": 2}, "session_header": "X-Conversation"},
            "tenants": [{"name": "a", "api_key_sha256": hash_api_key("k")}],
            "public_prefixes": [{"system": "be nice"}, {"text": "<|im_start|>"}],
            "limits": {"max_body_bytes": 1000},
            "disaggregation": {"min_remote_prefill_tokens": 300, "transfer_timeout_s": 2},
        }
    )
    # kv_usage: the KV scorer's earlier name, read as kv_cache_usage.
    assert config.weights["kv_cache_usage"] == 2 and config.weights["prefix_cache"] == 1.0
    assert "kv_usage" not in config.weights
    assert config.session_header == "x-conversation"
    assert config.tenants.lookup("k") is not None
    assert [p.system for p in config.public_prefixes] == ["be nice", None]
    assert config.max_body_bytes == 1000
    assert default.disaggregation == DisaggregationConfig(
        enabled=True, min_remote_prefill_tokens=512, max_prefill_queue_depth=8,
        transfer_timeout_s=30.0,
    )  # fmt: skip
    assert config.disaggregation == DisaggregationConfig(
        enabled=True, min_remote_prefill_tokens=300, max_prefill_queue_depth=8,
        transfer_timeout_s=2.0,
    )  # fmt: skip
    off = parse_config({"disaggregation": {"enabled": False, "max_prefill_queue_depth": 0}})
    assert not off.disaggregation.enabled and off.disaggregation.max_prefill_queue_depth == 0


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"routing": {"wieghts": {}}}, "unknown fields"),
        ({"tenant": []}, "unknown fields"),
        ({"limits": {"max_body_bytes": 0}}, "positive integer"),
        ({"public_prefixes": [{"system": "a", "text": "b"}]}, "public_prefixes[0]"),
        ({"tenants": {"name": "a"}}, "must be a list"),
        ([1, 2], "YAML mapping"),
        ({"disaggregation": {"min_prefill_tokens": 1}}, "disaggregation has unknown fields"),
        ({"disaggregation": {"enabled": "yes"}}, "disaggregation.enabled must be true or false"),
        ({"disaggregation": {"min_remote_prefill_tokens": -1}}, "integer >= 0"),
        ({"disaggregation": {"max_prefill_queue_depth": 2.5}}, "integer >= 0"),
        ({"disaggregation": {"max_prefill_queue_depth": True}}, "integer >= 0"),
        ({"disaggregation": {"transfer_timeout_s": 0}}, "transfer_timeout_s must be a number"),
        ({"disaggregation": {"transfer_timeout_s": "10s"}}, "transfer_timeout_s must be a number"),
        ({"disaggregation": [1]}, "disaggregation must be a mapping"),
    ],
)
def test_config_errors_name_the_field(raw: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw)


def test_tenant_errors_surface_through_the_config() -> None:
    with pytest.raises(TenantConfigError):
        parse_config({"tenants": [{"name": "a"}]})


def test_worker_list_parsing() -> None:
    assert parse_worker_list("a:1, b.example:50051,[::1]:7") == ["a:1", "b.example:50051",
                                                               "[::1]:7"]  # fmt: skip
    for bad in ("a", "a:", ":5", "a:99999", "a:x"):
        with pytest.raises(DiscoveryConfigError, match="host:port"):
            parse_worker_list(bad)


@dataclass(frozen=True)
class ScriptedDns(DnsWorkers):
    """DnsWorkers whose lookups follow a script: a list of addresses, or an OSError to
    raise (what a failed getaddrinfo raises). After the script, the last answer repeats."""

    script: tuple[list[str] | OSError, ...] = ()
    calls: list[int] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def resolve(self) -> list[str]:
        self.calls.append(1)
        step = self.script[min(len(self.calls), len(self.script)) - 1]
        if len(self.calls) >= len(self.script):
            self.done.set()
        if isinstance(step, OSError):
            raise step
        return step


def test_dns_resolution_is_real_and_a_bad_name_raises() -> None:
    async def run() -> None:
        assert "127.0.0.1:50051" in await DnsWorkers("localhost", 50051).resolve()
        # Awaited, however slow the resolver: the failure is seen, never assumed.
        with pytest.raises(OSError):
            await DnsWorkers("no-such-host.invalid", 1).resolve()

    asyncio.run(run())


def test_dns_discovery_applies_changes_only_and_keeps_workers_through_failures() -> None:
    applied: list[list[str]] = []

    async def apply(addresses: list[str]) -> None:
        applied.append(addresses)

    failure = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    dns = ScriptedDns("pool.svc", 1, interval_s=0.001, script=(
        ["a:1"], ["a:1"], failure, failure, ["a:1"], ["a:1", "b:1"], failure, ["a:1", "b:1"],
    ))  # fmt: skip

    async def run() -> None:
        task = asyncio.create_task(dns.run(apply))
        # Until every scripted answer was used, however slow the machine.
        await asyncio.wait_for(dns.done.wait(), timeout=30)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    # Repeats are not applied; failures apply nothing (never an empty pool); a change is.
    assert applied == [["a:1"], ["a:1", "b:1"]]


def test_public_prefix_blocks() -> None:
    prefixes = PublicPrefixes([list(range(40)), list(range(100, 132))])
    assert prefixes.num_public_blocks(list(range(50)), 16) == 2  # 40 tokens: 2 full blocks
    assert prefixes.num_public_blocks(list(range(20)), 16) == 1  # the prompt is shorter
    assert prefixes.num_public_blocks([*range(16), 999, *range(17, 40)], 16) == 1
    assert prefixes.num_public_blocks(list(range(100, 140)), 16) == 2
    assert prefixes.num_public_blocks([5] * 64, 16) == 0
    assert PublicPrefixes([]).num_public_blocks(list(range(64)), 16) == 0
