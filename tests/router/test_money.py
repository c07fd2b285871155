"""Cost in money: prices parsed exactly, spend == tokens x prices to the pico-dollar,
budgets judged per UTC day and month, and the in-process store crossing the warning and the
hard limit. The Redis store's side: test_budgets_redis.py; end to end: gateway/test_budgets.py.
"""

from __future__ import annotations

import asyncio
import calendar
import random
from decimal import Decimal

import pytest

from kvflow.router.settings import ConfigError, parse_config
from kvflow.router.tenants.config import Quotas, Tenant, TenantConfigError, parse_tenants
from kvflow.router.tenants.money import (
    Budgets,
    ModelPrices,
    judge_budgets,
    parse_prices,
    seconds_until_next_utc_month,
    spend_pusd,
    usd_to_pusd,
    utc_month,
)
from kvflow.router.tenants.store import MemoryQuotaStore, UsageTotals

USD = 10**12  # pico-USD


def test_spend_is_exactly_tokens_times_prices() -> None:
    rng = random.Random(7)
    for _ in range(500):
        raw = {k: f"{rng.randint(0, 100)}.{rng.randint(0, 999_999):06d}" for k in
               ("input_usd_per_million_tokens", "cached_input_usd_per_million_tokens",
                "output_usd_per_million_tokens")}  # fmt: skip
        prices = parse_prices({"m": raw}, ConfigError)["m"]
        prompt, completion = rng.randint(0, 10**6), rng.randint(0, 10**5)
        cached = rng.randint(0, prompt)
        expected_usd = (
            (prompt - cached) * Decimal(raw["input_usd_per_million_tokens"])
            + cached * Decimal(raw["cached_input_usd_per_million_tokens"])
            + completion * Decimal(raw["output_usd_per_million_tokens"])
        ) / 10**6
        got = spend_pusd(prices, prompt_tokens=prompt, cached_tokens=cached,
                         completion_tokens=completion)  # fmt: skip
        assert Decimal(got) / USD == expected_usd


def test_prices_parse_exactly_and_refuse_what_cannot_be_exact() -> None:
    prices = parse_prices(
        {"m": {"input_usd_per_million_tokens": 0.15, "output_usd_per_million_tokens": "0.6"}},
        ConfigError,
    )["m"]
    # 0.15 USD per million tokens is 150_000 pico-USD per token; cached defaults to input.
    assert prices == ModelPrices(150_000, 150_000, 600_000)
    for bad in ({"input_usd_per_million_tokens": "0.0000001"},  # 7 decimals
                {"input_usd_per_million_tokens": -1},
                {"input_usd_per_million_tokens": "lots"},
                {"input_usd_per_million_tokens": True},
                {"input_usd_per_million_tokens": "NaN"},
                {"price": 1}):  # fmt: skip
        with pytest.raises(ConfigError, match=r"prices\.m"):
            parse_prices({"m": bad}, ConfigError)
    with pytest.raises(ConfigError):
        parse_prices(["m"], ConfigError)
    config = parse_config({"prices": {"sim": {"output_usd_per_million_tokens": 2}}})
    assert config.prices["sim"].output_pusd == 2_000_000


def test_tenant_budgets_parse_and_refuse_bad_values() -> None:
    directory = parse_tenants([{"name": "a", "api_key_sha256": "0" * 64,
                                "daily_budget_usd": "10.50", "monthly_budget_usd": 200,
                                "budget_warning_fraction": 0.9}])  # fmt: skip
    assert directory.tenants["a"].quotas.budgets == Budgets(10_500_000_000_000, 200 * USD, 0.9)
    for bad in ({"daily_budget_usd": 0}, {"monthly_budget_usd": "-1"},
                {"budget_warning_fraction": 0}, {"budget_warning_fraction": 1.5}):  # fmt: skip
        with pytest.raises(TenantConfigError):
            parse_tenants([{"name": "a", "api_key_sha256": "0" * 64, **bad}])
    assert usd_to_pusd("0.000000000001", "x", ValueError) == 1
    with pytest.raises(ValueError, match="12 decimals"):
        usd_to_pusd("0.0000000000001", "x", ValueError)


def test_months_and_their_resets_are_utc() -> None:
    dec_31 = calendar.timegm((2026, 12, 31, 23, 0, 0))
    assert seconds_until_next_utc_month(dec_31) == 3600
    assert utc_month(dec_31 + 3600) == utc_month(dec_31) + 1
    assert utc_month(0) == 0


def test_budgets_warn_past_the_fraction_and_refuse_at_the_limit() -> None:
    budgets = Budgets(daily_pusd=10 * USD, monthly_pusd=100 * USD, warning_fraction=0.8)
    now_s = calendar.timegm((2026, 12, 5, 12, 0, 0))
    assert judge_budgets(budgets, day_pusd=7 * USD, month_pusd=7 * USD, now_s=now_s).warning is None
    warned = judge_budgets(budgets, day_pusd=8_200_000_000_000, month_pusd=9 * USD, now_s=now_s)
    assert (warned.exceeded, warned.warning) == (None, "daily 82% of 10.00 USD")
    monthly = judge_budgets(budgets, day_pusd=1 * USD, month_pusd=95 * USD, now_s=now_s)
    assert monthly.warning == "monthly 95% of 100.00 USD"
    refused = judge_budgets(budgets, day_pusd=10 * USD, month_pusd=10 * USD, now_s=now_s)
    assert refused.exceeded == "daily_budget_usd" and refused.retry_after_s == 12 * 3600
    refused = judge_budgets(budgets, day_pusd=0, month_pusd=100 * USD, now_s=now_s)
    assert refused.exceeded == "monthly_budget_usd"
    assert refused.retry_after_s == seconds_until_next_utc_month(now_s)


class FakeClock:
    def __init__(self, now_s: float) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def test_memory_store_warns_then_refuses_and_resets_at_the_utc_day_and_month() -> None:
    clock = FakeClock(calendar.timegm((2026, 12, 31, 22, 0, 0)))
    store = MemoryQuotaStore(clock)
    t = Tenant("t", None, 0, Quotas(budgets=Budgets(4 * USD, 7 * USD, 0.5)), cache_salt="t")

    async def spend(usd: int) -> None:
        admission = await store.admit(t, lease_id="x", prompt_tokens=1)
        assert admission.is_admitted
        await store.finish(t, lease_id="x", prompt_tokens=1, completion_tokens=1,
                           usage=UsageTotals(spend_pusd=usd * USD))  # fmt: skip

    async def run() -> None:
        await spend(1)
        assert (await store.check(t, reserved_tokens=1)).budget_warning is None
        await spend(1)  # 2 of 4 USD today: the warning from here on
        admission = await store.admit(t, lease_id="y", prompt_tokens=1)
        assert admission.budget_warning == "daily 50% of 4.00 USD"
        assert admission.warning_budget == "daily"
        await store.finish(t, lease_id="y", prompt_tokens=1, completion_tokens=1,
                           usage=UsageTotals(spend_pusd=2 * USD))  # fmt: skip
        refused = await store.check(t, reserved_tokens=1)
        assert (refused.is_admitted, refused.limit) == (False, "daily_budget_usd")
        assert refused.retry_after_s == 2 * 3600
        clock.now_s += 2 * 3600  # a new day and a new month: both budgets start over
        assert (await store.check(t, reserved_tokens=1)).budget_warning is None
        await spend(3)
        await spend(1)  # 4 USD: the daily budget spent again
        assert (await store.check(t, reserved_tokens=1)).limit == "daily_budget_usd"
        clock.now_s += 86_400  # the next day: 4 USD this month of 7, past the warning
        assert (await store.check(t, reserved_tokens=1)).budget_warning == "monthly 57% of 7.00 USD"
        await spend(3)
        refused = await store.check(t, reserved_tokens=1)
        assert refused.limit == "monthly_budget_usd"
        assert refused.retry_after_s == seconds_until_next_utc_month(clock.now_s)
        assert (await store.read_usage(t)).spend_pusd == 11 * USD

    asyncio.run(run())


def test_usage_log_line_writes_the_spend_exactly() -> None:
    from kvflow.router.api.accounting import _usd

    assert _usd(0) == "0"
    assert _usd(2 * USD) == "2"
    assert _usd(2 * USD + 123) == "2.000000000123"
    assert _usd(150_000) == "0.00000015"
