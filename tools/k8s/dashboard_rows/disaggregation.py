"""The prefill/decode disaggregation row: plans, KV handoffs and their transfers."""

from __future__ import annotations

from dashboard_query import Panel, p99, rate

TITLE = "Prefill/decode disaggregation"

PANELS: list[Panel] = [
    Panel(
        "Plans",
        "reqps",
        (rate("kvflow_router_pd_decisions_total", "decision, reason"),),
        "Colocated or disaggregated, and why.",
        stack=True,
    ),
    Panel(
        "KV handoffs and failures",
        "reqps",
        (
            rate("kvflow_router_pd_transfers_total", "outcome", "handoff"),
            rate("kvflow_router_pd_failures_total", "kind", "failure"),
        ),
    ),
    Panel(
        "Prefill and transfer",
        "s",
        (
            p99("kvflow_router_pd_prefill_seconds", "prefill P99"),
            p99("kvflow_router_pd_transfer_seconds", "transfer P99"),
        ),
        "P99 of the prefill call and of the KV send, as prefill workers report.",
    ),
    Panel(
        "Transferred",
        "Bps",
        (
            rate("kvflow_router_pd_transfer_bytes_total", "pool", "sent (gateway)"),
            rate("kvflow_worker_kv_transfer_bytes_total", "direction", "(workers)"),
        ),
        "KV bytes per second, gateway's and workers' view.",
    ),
    Panel(
        "Worker transfers",
        "reqps",
        (rate("kvflow_worker_kv_transfers_total", "direction, outcome"),),
    ),
]
