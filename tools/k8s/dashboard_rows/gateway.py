"""The gateway row: what tenants see (requests, 5xx ratio, TTFT, TPOT, ITL, end to end,
per model) and how the gateways route (workers seen, decisions, prefix reuse)."""

from __future__ import annotations

from dashboard_query import API, RATE, SEL, Panel, p90_by_model, quantiles, rate

TITLE = "Gateway: what tenants see"

PANELS: list[Panel] = [
    Panel(
        "Requests by status",
        "reqps",
        (rate("kvflow_router_requests_total", "code", selector=API),),
        "Answers of the /v1 endpoints per second, by HTTP status.",
        stack=True,
    ),
    Panel(
        "5xx ratio",
        "percentunit",
        (
            (
                f'sum(rate(kvflow_router_requests_total{{{API}, code=~"5.."}}{RATE}))'
                f" / sum(rate(kvflow_router_requests_total{{{API}}}{RATE}))",
                "5xx",
            ),
        ),
        "What KvflowErrorRateHigh alerts on. 429s (tenant limits) are not errors.",
    ),
    Panel(
        "TTFT",
        "s",
        quantiles("kvflow_router_ttft_seconds"),
        "Arrival at the gateway to the first token: queueing, routing and prefill.",
    ),
    Panel(
        "TPOT",
        "s",
        quantiles("kvflow_router_tpot_seconds"),
        "Per request, (last token - first token) / (completion tokens - 1), at the gateway.",
    ),
    Panel(
        "ITL",
        "s",
        quantiles("kvflow_router_itl_seconds"),
        "Inter-token latency as clients see it: the time between a choice's successive "
        "token messages at the gateway.",
    ),
    Panel(
        "End to end",
        "s",
        quantiles("kvflow_router_e2e_seconds"),
        "Arrival at the gateway to the last token.",
    ),
    Panel(
        "TTFT P90 by model",
        "s",
        p90_by_model("kvflow_router_ttft_seconds"),
        "Per served model (the response's `model`): a canary next to the version it "
        "may replace, behind one gateway.",
    ),
    Panel(
        "TPOT P90 by model",
        "s",
        p90_by_model("kvflow_router_tpot_seconds"),
        "Per served model (the response's `model`): a canary next to the version it "
        "may replace, behind one gateway.",
    ),
    Panel(
        "Errors by model",
        "percentunit",
        (
            (
                "sum by (model) (rate(kvflow_router_model_requests_total{"
                + SEL
                + ', code=~"5.."}'
                + RATE
                + ")) / sum by (model) "
                "(rate(kvflow_router_model_requests_total{" + SEL + "}" + RATE + "))",
                "{{model}}",
            ),
        ),
        "Share of a served model's requests answered 5xx: a canary's errors next to its "
        "old version's (requests refused before a model's pool was chosen not counted).",
    ),
    Panel(
        "Workers seen by the gateways",
        "short",
        (
            ("max by (pool) (kvflow_router_workers{" + SEL + "})", "{{pool}} known"),
            ("min by (pool) (kvflow_router_workers_healthy{" + SEL + "})", "{{pool}} healthy"),
        ),
        "Known from discovery, and passing health probes (the least of the replicas).",
    ),
    Panel(
        "Routing decision",
        "s",
        quantiles("kvflow_router_routing_decision_seconds"),
        "Block hashing, index lookup and scoring per request.",
    ),
    Panel(
        "Prefix reuse and failovers",
        "short",
        (
            rate("kvflow_router_prefix_matched_blocks_total", "pool", "matched blocks"),
            rate("kvflow_router_failovers_total", "pool", "failovers"),
            (
                "max by (pool) (kvflow_router_index_blocks{" + SEL + "})",
                "{{pool}} index blocks",
            ),
        ),
        "Matched blocks/s (the chosen worker already cached them), failovers/s, and the "
        "routing index's size.",
    ),
    Panel(
        "Where requests went, by their prefix",
        "reqps",
        (rate("kvflow_router_prefix_outcomes_total", "outcome"),),
        "Relative to the worker holding most of each prompt: best_holder, passed_over (its "
        "load cost more than the hit saves: add capacity), copy (of a shared prefix), "
        "no_prefix (held nowhere: add KV cache). docs/router.md, Metrics.",
        stack=True,
    ),
]
