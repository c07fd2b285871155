"""The levels' pure arithmetic: buckets, in-flight leases, the client's address behind
proxies, the config section and the flags laid over it."""

from __future__ import annotations

import argparse
import asyncio
import math

import pytest

from kvflow.router.cli_rate_limits import apply_rate_limit_flags, rate_limit_flags
from kvflow.router.config_fields import ConfigError
from kvflow.router.limits.client_ip import UNKNOWN_CLIENT, client_address
from kvflow.router.limits.decide import (
    SlotState,
    is_idle,
    judge,
    renew,
    settle,
    tokens_required,
)
from kvflow.router.limits.errors import LIMIT_HEADER, LimitExceededError
from kvflow.router.limits.levels import LevelLimits, LimitsConfig, Slot, parse_cidrs
from kvflow.router.limits.store import MemoryLimitStore
from kvflow.router.settings import parse_config

MODEL = Slot("model", "llama", LevelLimits(requests_per_minute=2, tokens_per_minute=100,
                                           max_in_flight=1))  # fmt: skip


def test_requests_per_minute_refills_per_second() -> None:
    slot = Slot("global", "", LevelLimits(requests_per_minute=2))
    state = SlotState()
    for i in range(2):
        refusal, state = judge(slot, state, 0.0, reserved_tokens=1, lease_id=str(i))
        assert refusal is None
    refusal, state = judge(slot, state, 0.0, reserved_tokens=1, lease_id="x")
    assert refusal is not None and refusal.kind == "requests_per_minute"
    assert refusal.retry_after_s == pytest.approx(30.0)  # one request refills in 60 / 2 s
    assert refusal.limit_name == "global/requests_per_minute"
    refusal, _ = judge(slot, state, 30.0, reserved_tokens=1, lease_id="y")
    assert refusal is None


def test_tokens_reserved_then_unused_given_back() -> None:
    slot = Slot("model", "m", LevelLimits(tokens_per_minute=100))
    refusal, state = judge(slot, SlotState(), 0.0, reserved_tokens=80, lease_id="a")
    assert refusal is None and state.tokens is not None and state.tokens.level == 20
    refusal, _ = judge(slot, state, 0.0, reserved_tokens=30, lease_id="b")
    assert refusal is not None and refusal.kind == "tokens_per_minute"
    assert refusal.retry_after_s == pytest.approx(6.0)  # 10 missing at 100 a minute
    # The first request used 30 of its 80: 50 come back, and the second fits.
    state = settle(slot, state, 0.0, lease_id="a", unused_tokens=50)
    assert judge(slot, state, 0.0, reserved_tokens=30, lease_id="b")[0] is None


def test_a_reservation_larger_than_the_minute_waits_for_a_full_bucket_not_forever() -> None:
    slot = Slot("model", "m", LevelLimits(tokens_per_minute=100))
    assert tokens_required(500, 100) == 100 and tokens_required(0, 100) == 1
    refusal, state = judge(slot, SlotState(), 0.0, reserved_tokens=500, lease_id="a")
    assert refusal is None and state.tokens is not None and state.tokens.level == -400
    refusal, _ = judge(slot, state, 60.0, reserved_tokens=1, lease_id="b")
    assert refusal is not None  # in debt: 3 more minutes
    assert refusal.retry_after_s == pytest.approx(180.0 + 0.6)
    # Giving back works on a bucket in debt too.
    state = settle(slot, state, 0.0, lease_id="a", unused_tokens=450)
    assert judge(slot, state, 0.0, reserved_tokens=1, lease_id="b")[0] is None


def test_in_flight_leases_expire_unless_renewed() -> None:
    slot = Slot("model", "m", LevelLimits(max_in_flight=1))
    refusal, state = judge(slot, SlotState(), 0.0, reserved_tokens=1, lease_id="a",
                           expiry_s=10.0)  # fmt: skip
    assert refusal is None
    refusal, _ = judge(slot, state, 9.0, reserved_tokens=1, lease_id="b", expiry_s=19.0)
    assert refusal is not None and (refusal.kind, refusal.retry_after_s) == ("max_in_flight", 1.0)
    renewed = renew(state, "a", 20.0)
    assert judge(slot, renewed, 15.0, reserved_tokens=1, lease_id="b")[0] is not None
    # Not renewed: the holder is gone, and at its expiry the slot is free again.
    assert judge(slot, state, 10.0, reserved_tokens=1, lease_id="b")[0] is None
    assert renew(SlotState(), "a", 20.0).leases == {}  # an expired lease stays gone
    assert settle(slot, state, 1.0, lease_id="a", unused_tokens=0).leases == {}


def test_cancelled_request_gives_back_its_request() -> None:
    slot = Slot("global", "", LevelLimits(requests_per_minute=1))
    _, state = judge(slot, SlotState(), 0.0, reserved_tokens=1, lease_id="a")
    assert judge(slot, state, 0.0, reserved_tokens=1, lease_id="b")[0] is not None
    state = settle(slot, state, 0.0, lease_id="a", unused_tokens=0, is_cancelled=True)
    assert judge(slot, state, 0.0, reserved_tokens=1, lease_id="b")[0] is None


def test_idle_state_is_forgettable() -> None:
    _, state = judge(MODEL, SlotState(), 0.0, reserved_tokens=10, lease_id="a")
    assert not is_idle(MODEL, state, 0.0)
    state = settle(MODEL, state, 0.0, lease_id="a", unused_tokens=0)
    assert not is_idle(MODEL, state, 1.0) and is_idle(MODEL, state, 60.0)


def test_memory_store_takes_from_every_level_or_none() -> None:
    asyncio.run(_memory_store_takes_from_every_level_or_none())


async def _memory_store_takes_from_every_level_or_none() -> None:
    now = [0.0]
    store = MemoryLimitStore(clock_s=lambda: now[0])
    ip = Slot("client_ip", "10.0.0.1", LevelLimits(requests_per_minute=10))
    full = Slot("global", "", LevelLimits(max_in_flight=1))
    assert await store.admit([ip, full], lease_id="a", reserved_tokens=1, is_check=False) is None
    refusal = await store.admit([ip, full], lease_id="b", reserved_tokens=1, is_check=False)
    assert refusal is not None and refusal.limit_name == "global/max_in_flight"
    # The refused request took nothing from the client's bucket either: 9 left, not 8.
    for i in range(9):
        assert await store.admit([ip], lease_id=f"c{i}", reserved_tokens=1, is_check=False) is None
    assert (await store.admit([ip], lease_id="d", reserved_tokens=1, is_check=True)) is not None
    # A check takes nothing.
    await store.finish([ip, full], lease_id="a", unused_tokens=0, is_cancelled=False)
    for _ in range(3):
        assert await store.admit([full], lease_id="e", reserved_tokens=1, is_check=True) is None
    # Idle counters (one per client address ever seen) are dropped on the next sweep.
    now[0] = 120.0
    await store.admit([], lease_id="f", reserved_tokens=1, is_check=True)
    assert store.num_counters() == 0


def test_model_level_applies_only_to_its_model() -> None:
    config = LimitsConfig(models={"llama": LevelLimits(max_in_flight=3)},
                          client_ip=LevelLimits(requests_per_minute=5))  # fmt: skip
    assert [s.level for s in config.slots("1.2.3.4", "llama")] == ["client_ip", "model"]
    assert [s.level for s in config.slots("1.2.3.4", "other")] == ["client_ip"]
    assert LimitsConfig().slots("1.2.3.4", "llama") == ()


TRUSTED = parse_cidrs(["10.0.0.0/8", "fd00::/8"], "test")


@pytest.mark.parametrize(
    ("peer", "forwarded", "expected"),
    [
        # An untrusted peer's header is ignored, whatever it says.
        ("203.0.113.7", ["198.51.100.1"], "203.0.113.7"),
        # Behind a trusted proxy: the right-most address it did not write itself.
        ("10.0.0.2", ["198.51.100.1"], "198.51.100.1"),
        # A client forging entries to the left: still the right-most untrusted.
        ("10.0.0.2", ["6.6.6.6, 198.51.100.1, 10.0.0.9"], "198.51.100.1"),
        # Several headers read as one list, in order.
        ("10.0.0.2", ["6.6.6.6", "198.51.100.1"], "198.51.100.1"),
        # Ports as some proxies write them.
        ("10.0.0.2", ["198.51.100.1:4242"], "198.51.100.1"),
        ("10.0.0.2", ["[2001:db8::1]:443"], "2001:db8::/64"),
        # Garbage a trusted proxy passed on: the last address it vouched for.
        ("10.0.0.2", ["198.51.100.1, bogus"], "10.0.0.2"),
        # No header from a trusted proxy: the proxy is the client.
        ("10.0.0.2", [], "10.0.0.2"),
        # IPv6 clients count per /64; IPv4-mapped addresses as IPv4.
        ("2001:db8:0:1::5", [], "2001:db8:0:1::/64"),
        ("::ffff:203.0.113.7", [], "203.0.113.7"),
        (None, ["198.51.100.1"], UNKNOWN_CLIENT),
    ],
)
def test_client_address(peer: str | None, forwarded: list[str], expected: str) -> None:
    assert client_address(peer, forwarded, TRUSTED) == expected


def test_without_trusted_proxies_the_peer_is_the_client() -> None:
    assert client_address("10.0.0.2", ["198.51.100.1"], ()) == "10.0.0.2"


def test_config_section_and_flags() -> None:
    config = parse_config({"rate_limits": {
        "global": {"requests_per_minute": 600, "max_in_flight": 10},
        "client_ip": {"max_in_flight": 2},
        "models": {"llama": {"tokens_per_minute": 1000}},
        "trusted_proxy_cidrs": ["10.0.0.0/8"],
        "lease_ttl_s": 5,
    }}).rate_limits  # fmt: skip
    assert config.global_limits == LevelLimits(600, None, 10)
    assert config.models["llama"] == LevelLimits(tokens_per_minute=1000)
    assert config.lease_ttl_s == 5.0 and len(config.trusted_proxies) == 1
    p = argparse.ArgumentParser()
    rate_limit_flags(p)
    args = p.parse_args(["--global-max-in-flight", "3", "--client-ip-requests-per-minute", "7",
                         "--trusted-proxy-cidrs", "192.168.0.0/16,::1/128"])  # fmt: skip
    merged = apply_rate_limit_flags(args, config)
    assert merged.global_limits == LevelLimits(600, None, 3)  # the flag over the file's
    assert merged.client_ip == LevelLimits(7, None, 2)
    assert [str(n) for n in merged.trusted_proxies] == ["192.168.0.0/16", "::1/128"]
    assert merged.models == config.models and merged.lease_ttl_s == 5.0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"global": {"max_concurrent": 1}}, "unknown fields"),
        ({"client_ip": {"requests_per_minute": 0}}, "must be an integer >= 1"),
        ({"models": {"m": {"max_in_flight": True}}}, "must be an integer >= 1"),
        ({"trusted_proxy_cidrs": ["10.0.0.1/8"]}, "is not a CIDR"),
        ({"trusted_proxy_cidrs": "10.0.0.0/8"}, "must be a list"),
        ({"lease_ttl_s": 0.5}, "lease_ttl_s must be"),
    ],
)
def test_bad_config_is_refused_naming_the_field(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"rate_limits": section})


def test_refusal_is_a_429_naming_the_limit() -> None:
    refusal, _ = judge(MODEL, SlotState(leases={"a": math.inf}), 0.0, reserved_tokens=1,
                       lease_id="b")  # fmt: skip
    assert refusal is not None
    error = LimitExceededError(refusal)
    assert error.status == 429 and error.code == "rate_limit_exceeded"
    assert error.headers() == {"retry-after": "1", LIMIT_HEADER: "model/llama/max_in_flight"}
    assert "model 'llama'" in error.message and "model/llama/max_in_flight" in error.message
    odd = Slot("model", "llâma 2", MODEL.limits)
    assert (
        LimitExceededError(refusal.__class__(odd, "max_in_flight", 1.0)).headers()[LIMIT_HEADER]
        == "model/ll%C3%A2ma%202/max_in_flight"
    )


def test_router_command_line_reads_the_flags() -> None:
    from kvflow.router.cli import parse_args

    flags = ["--global-max-in-flight", "3", "--client-ip-tokens-per-minute", "900",
             "--trusted-proxy-cidrs", "10.0.0.0/8", "--limit-lease-ttl-s", "5"]  # fmt: skip
    settings = parse_args(flags)
    assert settings is not None
    limits = settings.config.rate_limits
    assert limits.global_limits == LevelLimits(max_in_flight=3)
    assert limits.client_ip == LevelLimits(tokens_per_minute=900)
    assert limits.lease_ttl_s == 5.0 and [str(n) for n in limits.trusted_proxies] == ["10.0.0.0/8"]
    with pytest.raises(ConfigError, match="not a CIDR"):
        parse_args(["--trusted-proxy-cidrs", "10.0.0.0/33"])
    with pytest.raises(ConfigError, match="--limit-lease-ttl-s must be >= 1"):
        parse_args(["--limit-lease-ttl-s", "0.5"])
