"""The tenants row: tokens, refusals, admissions, spend and budget warnings per tenant."""

from __future__ import annotations

from dashboard_query import RATE, SEL, Panel, rate

TITLE = "Tenants"

PANELS: list[Panel] = [
    Panel(
        "Completion tokens",
        "short",
        (rate("kvflow_router_tenant_completion_tokens_total", "tenant"),),
        "Tokens per second by tenant.",
        stack=True,
    ),
    Panel(
        "Prompt tokens and cache share",
        "short",
        (
            rate("kvflow_router_tenant_prompt_tokens_total", "tenant", "prompt"),
            rate("kvflow_router_tenant_cached_tokens_total", "tenant", "cached"),
        ),
        "Prompt tokens per second by tenant, and those served from a prefix cache.",
    ),
    Panel(
        "Refused by limits",
        "reqps",
        (rate("kvflow_router_tenant_rejections_total", "tenant, limit"),),
        "Requests refused with 429 by a quota or rate limit.",
    ),
    Panel(
        "Admitted requests",
        "reqps",
        (rate("kvflow_router_tenant_requests_total", "tenant"),),
        stack=True,
    ),
    Panel(
        "Spend",
        "currencyUSD",
        (
            (
                f"sum by (tenant) (rate(kvflow_router_tenant_spend_usd_total{{{SEL}}}{RATE}))"
                " * 3600",
                "{{tenant}} per hour",
            ),
        ),
        "USD per hour by tenant, at the configured prices (docs/router.md, Tenants).",
        stack=True,
    ),
    Panel(
        "Budget warnings",
        "reqps",
        (rate("kvflow_router_tenant_budget_warnings_total", "tenant, budget"),),
        "Requests admitted past a daily or monthly budget's warning fraction: the tenant "
        "is about to be refused with 429.",
    ),
]
