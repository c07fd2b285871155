"""Cost in money: each model's prices, a request's spend, and the budgets it counts against.
Pure.

Money is held as whole pico-dollars (1e-12 USD) in integers, never floats: a price in USD
per million tokens with up to six decimals is a whole number of pico-dollars per token, so
a request's spend is exactly tokens x prices, and sums of spends in Redis (INCRBY, 64-bit)
or here never drift. A signed 64-bit counter holds about 9.2 million USD, far above any one
tenant's daily or monthly spend.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

PICO_USD_PER_USD = 10**12
# USD per million tokens -> pico-USD per token: x 1e12 / 1e6.
_PICO_USD_PER_TOKEN_PER_USD_PER_MILLION = 10**6
DEFAULT_BUDGET_WARNING_FRACTION = 0.8
PRICE_FIELDS = (
    "input_usd_per_million_tokens",
    "cached_input_usd_per_million_tokens",
    "output_usd_per_million_tokens",
)


@dataclass(frozen=True)
class ModelPrices:
    """One model's prices, in pico-USD per token."""

    input_pusd: int = 0
    cached_input_pusd: int = 0
    output_pusd: int = 0


FREE = ModelPrices()


def spend_pusd(
    prices: ModelPrices, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int
) -> int:
    """What a request costs. ``prompt_tokens`` counts the cached ones too (OpenAI's usage),
    which are charged at the cached-input price instead of the input price."""
    cached = min(cached_tokens, prompt_tokens)
    return (
        (prompt_tokens - cached) * prices.input_pusd
        + cached * prices.cached_input_pusd
        + completion_tokens * prices.output_pusd
    )


def discounted_pusd(pusd: int, factor: Fraction) -> int:
    """A spend times a price factor (a batch's discount), rounded down to a whole
    pico-dollar: exact, as the factor is a fraction and not a float."""
    return int(pusd * factor)


def usd_to_pusd(value: object, where: str, error: type[ValueError]) -> int:
    """A non-negative amount of USD (number or decimal string, at most 12 decimals) in
    pico-USD, exactly: parsed as a decimal, never through a float's binary fraction."""
    try:
        amount = Decimal(str(value)) if not isinstance(value, bool) else None
    except InvalidOperation:
        amount = None
    if amount is None or not amount.is_finite() or amount < 0:
        raise error(f"{where} must be a non-negative amount of USD, got {value!r}")
    pusd = amount * PICO_USD_PER_USD
    if pusd != pusd.to_integral_value():
        raise error(f"{where} has more than 12 decimals: {value!r}")
    return int(pusd)


def _price(raw: Mapping[str, Any], key: str, where: str, error: type[ValueError]) -> int:
    per_million = usd_to_pusd(raw.get(key, 0), f"{where}.{key}", error)
    if per_million % _PICO_USD_PER_TOKEN_PER_USD_PER_MILLION:
        raise error(f"{where}.{key} has more than 6 decimals: {raw.get(key)!r}")
    return per_million // _PICO_USD_PER_TOKEN_PER_USD_PER_MILLION


def parse_prices(raw: object, error: type[ValueError]) -> Mapping[str, ModelPrices]:
    """The config's ``prices`` section: served model name -> its three prices in USD per
    million tokens (each left out is free)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error("prices must map model names to their prices")
    prices = {}
    for model, entry in raw.items():
        where = f"prices.{model}"
        if not isinstance(entry, dict):
            raise error(f"{where} must be a mapping of {list(PRICE_FIELDS)}")
        unknown = sorted(set(entry) - set(PRICE_FIELDS))
        if unknown:
            raise error(f"{where} has unknown fields {unknown}; known: {list(PRICE_FIELDS)}")
        input_pusd, cached_pusd, output_pusd = (
            _price(entry, k, where, error) for k in PRICE_FIELDS
        )
        if "cached_input_usd_per_million_tokens" not in entry:
            cached_pusd = input_pusd  # no discount unless one is configured
        prices[str(model)] = ModelPrices(input_pusd, cached_pusd, output_pusd)
    return prices


def format_usd(pusd: int) -> str:
    """Cents for a header or a message: 10.00 USD."""
    return f"{Decimal(pusd) / PICO_USD_PER_USD:.2f} USD"


# -- budgets ------------------------------------------------------------------------------


def utc_month(now_s: float) -> int:
    """Months since 1970-01 (UTC): the monthly budget's period."""
    t = time.gmtime(now_s)
    return (t.tm_year - 1970) * 12 + t.tm_mon - 1


def seconds_until_next_utc_month(now_s: float) -> float:
    t = time.gmtime(now_s)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return calendar.timegm((year, month, 1, 0, 0, 0)) - now_s


@dataclass(frozen=True)
class Budgets:
    """A tenant's spend limits in pico-USD; None: none."""

    daily_pusd: int | None = None
    monthly_pusd: int | None = None
    # Spend at or above this fraction of a budget is answered with a warning header.
    warning_fraction: float = DEFAULT_BUDGET_WARNING_FRACTION


@dataclass(frozen=True)
class BudgetVerdict:
    # The budget spent (daily_budget_usd or monthly_budget_usd), None: within both.
    exceeded: str | None = None
    retry_after_s: float = 0.0
    # "daily 82% of 10.00 USD" when spend is past the warning fraction of a budget.
    warning: str | None = None
    warning_budget: str | None = None  # which: daily or monthly


def judge_budgets(
    budgets: Budgets, *, day_pusd: int, month_pusd: int, now_s: float
) -> BudgetVerdict:
    """Refused once spend reached a budget (the day's before the month's: it resets first);
    otherwise a warning for the budget most used past the warning fraction."""
    periods = (
        ("daily", budgets.daily_pusd, day_pusd, 86_400 - now_s % 86_400),
        ("monthly", budgets.monthly_pusd, month_pusd, seconds_until_next_utc_month(now_s)),
    )
    for name, limit, spent, reset_s in periods:
        if limit is not None and spent >= limit:
            return BudgetVerdict(f"{name}_budget_usd", reset_s)
    worst: tuple[float, str, int] | None = None
    for name, limit, spent, _ in periods:
        if limit:
            fraction = spent / limit
            if fraction >= budgets.warning_fraction and (worst is None or fraction > worst[0]):
                worst = (fraction, name, limit)
    if worst is None:
        return BudgetVerdict()
    fraction, name, limit = worst
    return BudgetVerdict(
        warning=f"{name} {int(fraction * 100)}% of {format_usd(limit)}", warning_budget=name
    )
