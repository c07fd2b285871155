"""The router's Prometheus metrics, in a registry the app owns (no module-level globals).

Names follow `kvflow_router_<what>_<unit>`. Per-tenant labels are safe: tenants come from
the configuration, so their number is bounded. So are the latency histograms' `model` (the
served name of the pool that answered, never the client's string: an unknown name is a 404
before any latency is observed) and the worker gauges' `pool` (the gateway's pools), so that
a canary's version can be judged next to the one it may replace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvflow.proto import metric_names as names
from kvflow.proto.priority_class import CLASS_WORDS
from kvflow.router.api.http_limits import REFUSAL_REASONS as HTTP_REFUSAL_REASONS
from kvflow.router.circuit_metrics import CircuitMetrics
from kvflow.router.limits.levels import KINDS as LIMIT_KINDS
from kvflow.router.limits.levels import LEVELS as LIMIT_LEVELS

# Routing decisions take tens of microseconds to a few milliseconds.
_DECISION_BUCKETS_S = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1,
)  # fmt: skip
_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
# Time per output token: 2 ms (a GPU's small batch) to 2 s (a busy CPU worker); TPOT
# targets are typically 20-200 ms, so the buckets are dense there.
_TPOT_BUCKETS_S = (
    0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
)  # fmt: skip
# A KV transfer: 1 ms (a few blocks on one host) to 10 s (the default transfer timeout).
_TRANSFER_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

# Every label value of the PD counters, so each series exists (at 0) from the start and the
# label sets stay bounded: dashboards can divide without waiting for the first event.
PD_DECISIONS = {
    "colocated": ("colocated_worker", "disabled", "no_prefill_worker", "few_missing_tokens",
                  "prefill_busy"),
    "disaggregated": ("many_missing_tokens",),
}  # fmt: skip
# sent: the prefill worker sent the blocks; nothing_to_send: the decode worker already held
# them all; not_reserved: the decode worker answered without a reservation; fallback: the
# prefill side failed and the decode worker prefilled the prompt itself.
PD_TRANSFER_OUTCOMES = ("sent", "nothing_to_send", "not_reserved", "fallback")
PD_FAILURE_KINDS = (
    "prefill_rejected",  # INVALID_ARGUMENT: a kv layout or version mismatch, a config bug
    "prefill_unavailable",  # the prefill worker is down or draining, or cannot reach decode
    "prefill_timeout",  # no PrefillResponse within transfer_timeout_s
    "prefill_failed",  # any other error (ABORTED: the send failed midway)
    "reservation_timeout",  # the decode worker did not reserve within transfer_timeout_s
    "decode_failed",  # the decode worker failed before its first token: re-planned
)

# Why admission control refused a request (serving/admission.py), by the status answered.
ADMISSION_REFUSALS = {
    "429": ("over_share",),
    # no_worker: the pool has no healthy worker (scaled to zero, or none up yet).
    "503": ("batch_shed", "cluster_full", "queues_full", "no_worker"),
}
DEADLINE_KINDS = ("first_token", "token_stall")  # workers/deadlines.py's DeadlineKind


class WorkerCounts(Protocol):
    """What the worker gauges read of a pool (workers/pool.py's WorkerPool)."""

    def num_healthy(self) -> int: ...

    def __len__(self) -> int: ...


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvflow_router_requests_total",
            "HTTP API requests by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        # Per model version (the served name of the pool that answered): a canary's error
        # rate next to its stable version's. Requests refused before a pool was chosen
        # (401, 400, 404, ...) are counted only above, so the label stays bounded. Label
        # pool: that pool's name (one per served name), so a gateway's refusals
        # (admission_rejections, by pool) have their pool's requests to be a share of.
        self.model_requests = Counter(
            "kvflow_router_model_requests_total",
            "Completion requests answered by a model's pool, by its served name, status and pool",
            ["model", "code", "pool"],
            registry=r,
        )
        self.ttft_s = Histogram(
            names.ROUTER_TTFT,
            "Request arrival at the gateway to its first token",
            # priority_class: the operator's planner sizes for the online classes only.
            ["model", names.CLASS_LABEL],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot_s = Histogram(
            names.ROUTER_TPOT,
            "Per request, (last token - first token) / (completion tokens - 1), at the gateway",
            ["model", names.CLASS_LABEL],
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.itl_s = Histogram(
            "kvflow_router_itl_seconds",
            "Inter-token latency at the gateway: time between a choice's successive token "
            "messages from its worker",
            ["model"],
            buckets=_TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e_s = Histogram(
            "kvflow_router_e2e_seconds",
            "Request arrival at the gateway to its last token",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decision_s = Histogram(
            "kvflow_router_routing_decision_seconds",
            "Time to choose a worker: block hashing, index lookup, scoring",
            buckets=_DECISION_BUCKETS_S,
            registry=r,
        )
        self.matched_blocks = Counter(
            "kvflow_router_prefix_matched_blocks_total",
            "Prompt blocks the chosen worker already cached, per the router's index",
            registry=r,
        )
        self.prefix_outcomes = Counter(
            "kvflow_router_prefix_outcomes_total",
            "Requests by where they went relative to the worker holding most of their prompt: "
            "best_holder, passed_over (for its load), copy (of a shared prefix), no_prefix "
            "(held nowhere)",
            ["outcome"],
            registry=r,
        )
        self.prepare_refusals = Counter(
            "kvflow_router_prepare_refusals_total",
            "Requests refused while preparing (template, tokenizer, grammar): busy (no "
            "prepare thread in time, 503) or timeout (the work ran past --prepare-timeout-s, "
            "400)",
            ["reason"],
            registry=r,
        )
        self.failovers = Counter(
            "kvflow_router_failovers_total",
            "Requests moved to another worker after one failed before the first token",
            registry=r,
        )
        self.pd_decisions = Counter(
            "kvflow_router_pd_decisions_total",
            "Execution plans by shape (colocated, disaggregated) and why",
            ["decision", "reason"],
            registry=r,
        )
        for decision, reasons in PD_DECISIONS.items():
            for reason in reasons:
                self.pd_decisions.labels(decision, reason)
        self.pd_transfers = Counter(
            "kvflow_router_pd_transfers_total",
            "Disaggregated attempts by what became of the KV handoff",
            ["outcome"],
            registry=r,
        )
        for outcome in PD_TRANSFER_OUTCOMES:
            self.pd_transfers.labels(outcome)
        self.pd_failures = Counter(
            "kvflow_router_pd_failures_total",
            "Failures of the prefill/decode handoff by kind",
            ["kind"],
            registry=r,
        )
        for kind in PD_FAILURE_KINDS:
            self.pd_failures.labels(kind)
        self.pd_transfer_tokens = Counter(
            "kvflow_router_pd_transfer_tokens_total",
            "Prompt tokens whose KV a prefill worker sent (the decode worker's reservation)",
            registry=r,
        )
        self.pd_transfer_bytes = Counter(
            "kvflow_router_pd_transfer_bytes_total",
            "KV bytes prefill workers sent, as they report",
            registry=r,
        )
        self.pd_transfer_s = Histogram(
            "kvflow_router_pd_transfer_seconds",
            "Gathering and sending one request's KV blocks, as the prefill worker reports",
            buckets=_TRANSFER_BUCKETS_S,
            registry=r,
        )
        self.pd_prefill_s = Histogram(
            "kvflow_router_pd_prefill_seconds",
            "Prefill call arrival to its blocks computed, as the prefill worker reports",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tenant_requests = Counter(
            "kvflow_router_tenant_requests_total", "Admitted requests", ["tenant"], registry=r
        )
        self.tenant_prompt_tokens = Counter(
            "kvflow_router_tenant_prompt_tokens_total", "Prompt tokens", ["tenant"], registry=r
        )
        self.tenant_completion_tokens = Counter(
            "kvflow_router_tenant_completion_tokens_total",
            "Completion tokens",
            ["tenant"],
            registry=r,
        )
        self.tenant_cached_tokens = Counter(
            "kvflow_router_tenant_cached_tokens_total",
            "Prompt tokens served from a worker's prefix cache",
            ["tenant"],
            registry=r,
        )
        # Labels bounded like the others: tenants are configured, models are the pools' served
        # names (the answering pool's, never what the client sent).
        self.tenant_spend_usd = Counter(
            "kvflow_router_tenant_spend_usd_total",
            "Spend at the configured prices (config `prices`), in USD",
            ["tenant", "model"],
            registry=r,
        )
        self.tenant_budget_warnings = Counter(
            "kvflow_router_tenant_budget_warnings_total",
            "Requests admitted past a budget's warning fraction (answered with a warning "
            "header), by budget: daily or monthly",
            ["tenant", "budget"],
            registry=r,
        )
        # By priority class (kvflow.proto.priority_class), three values: what each class got
        # and what admission shed of it, which shows the shedding order at work.
        self.class_requests = Counter(
            "kvflow_router_priority_class_requests_total",
            "Admitted requests, by the priority class they ran as",
            ["priority_class"],
            registry=r,
        )
        self.class_rejections = Counter(
            "kvflow_router_priority_class_rejections_total",
            "Requests refused for capacity, by priority class and why: admission control's"
            " reasons, or workers_refused (every worker tried refused or failed it: a 503)",
            ["priority_class", "reason"],
            registry=r,
        )
        for word in CLASS_WORDS:
            self.class_requests.labels(word)
        self.tenant_rejections = Counter(
            "kvflow_router_tenant_rejections_total",
            "Requests refused by a quota or rate limit",
            ["tenant", "limit"],
            registry=r,
        )
        # Both labels from fixed sets (not the model or address): bounded, and every
        # series exists at 0 from the start.
        self.limit_rejections = Counter(
            "kvflow_router_limit_rejections_total",
            "Requests refused (429) by a limit of a model, a client address or the whole "
            "gateway, by level and limit",
            ["level", "limit"],
            registry=r,
        )
        for level in LIMIT_LEVELS:
            for kind in LIMIT_KINDS:
                self.limit_rejections.labels(level, kind)
        # Label pool: a gateway's pools each have their own admission control, and each
        # pool's planner counts only its own refusals as its demand (docs/planner.md).
        self.admission_rejections = Counter(
            names.ROUTER_SHED,
            "Requests admission control refused before any worker saw them, by the status "
            "answered (429: a tenant over its share; 503: the cluster is full), why, and "
            "the pool refusing, and the refused request's priority class",
            ["code", "reason", "pool", names.CLASS_LABEL],
            registry=r,
        )
        self.deadline_misses = Counter(
            "kvflow_router_deadline_misses_total",
            "Worker streams cancelled for missing a deadline: no first token within "
            "--first-token-timeout-s, or no next token within --token-stall-timeout-s",
            ["kind"],
            registry=r,
        )
        for kind in DEADLINE_KINDS:
            self.deadline_misses.labels(kind)
        # Label worker: the pool's workers (host:port), bounded by its size, as the index's.
        self.worker_rejections = Counter(
            "kvflow_router_worker_rejections_total",
            "Calls a worker refused with its queue full (RESOURCE_EXHAUSTED), by worker; "
            "the request went to another worker or got 503",
            ["worker"],
            registry=r,
        )
        # Label pool: the gateway's pools (`pools:`, or DEFAULT_POOL from the command line).
        self._workers_healthy = Gauge(
            "kvflow_router_workers_healthy",
            "Workers passing health probes, by pool",
            ["pool"],
            registry=r,
        )
        self._workers_known = Gauge(
            "kvflow_router_workers", "Workers known from discovery, by pool", ["pool"], registry=r
        )
        self._index_blocks = Gauge(
            "kvflow_router_index_blocks", "Distinct block hashes in the routing index", registry=r
        )
        self._security_metrics(r)
        self.circuits = CircuitMetrics(r)  # the circuit breakers' (circuit_metrics.py)

    # --- exposure and security (docs/router.md, Security) ----------------------------------

    def _security_metrics(self, r: CollectorRegistry) -> None:
        self.http_refusals = Counter(
            "kvflow_router_http_refusals_total",
            "Connections refused or cut by the HTTP listener's limits (api/http_limits.py), "
            "by reason",
            ["reason"],
            registry=r,
        )
        for reason in HTTP_REFUSAL_REASONS:
            self.http_refusals.labels(reason)
        self.quota_store_fallbacks = Counter(
            "kvflow_router_quota_store_fallbacks_total",
            "Quota decisions taken without Redis (it failed), by what was done instead: "
            "memory (limits of this replica only) or deny (503)",
            ["action"],
            registry=r,
        )
        for action in ("memory", "deny"):
            self.quota_store_fallbacks.labels(action)
        self.tenants_reload_failures = Counter(
            "kvflow_router_tenants_reload_failures_total",
            "Tenants file changes that could not be applied (the last good tenants stay)",
            registry=r,
        )
        self.tenants_stale = Gauge(
            "kvflow_router_tenants_stale",
            "1 while the tenants file's latest content failed to load and older tenants "
            "(keys) stay in force, else 0",
            registry=r,
        )

    def http_refusals_for(self, reason: str) -> None:
        self.http_refusals.labels(reason).inc()

    def admission_pool(self, pool: str) -> None:
        """Create the pool's refusal series at 0, so a pool that never refused reads 0."""
        for code, reasons in ADMISSION_REFUSALS.items():
            for reason in reasons:
                for word in CLASS_WORDS:
                    self.admission_rejections.labels(code, reason, pool, word)

    def watch(
        self, pools: Mapping[str, WorkerCounts], num_index_blocks: Callable[[], float]
    ) -> None:
        """Gauges read at scrape time from the live objects: each pool's workers, by name."""
        for name, workers in pools.items():
            self._workers_healthy.labels(name).set_function(workers.num_healthy)
            self._workers_known.labels(name).set_function(partial(len, workers))
        self._index_blocks.set_function(num_index_blocks)
