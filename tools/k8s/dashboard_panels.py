"""The dashboard's panels, row by row: the reviewable list `gen_dashboard.py` renders into
Grafana JSON. Every series queried is one the chart's PodMonitors scrape (job, namespace,
pod, pool, role labels); tests/k8s/test_observability.py checks each metric name against
the code.
"""

from __future__ import annotations

from dataclasses import dataclass

SEL = 'namespace=~"$namespace", pool=~"$pool"'
API = SEL + ', endpoint=~"/v1/.+"'  # probes and scrapes are not tenants' traffic
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    stack: bool = False


def quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    """P50, P90 and P99 of a histogram over the selected pools."""
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}{RATE})))",
            f"{prefix}P{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def p90_by_model(metric: str) -> tuple[tuple[str, str], ...]:
    """P90 per served model (the router's `model` label: the version that answered), so a
    canary's latency shows next to the version it may replace."""
    expr = f"histogram_quantile(0.9, sum by (le, model) (rate({metric}_bucket{{{SEL}}}{RATE})))"
    return ((expr, "{{model}}"),)


def p99(metric: str, legend: str) -> tuple[str, str]:
    return f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{{{SEL}}}{RATE})))", legend


def rate(metric: str, by: str, what: str = "", selector: str = SEL) -> tuple[str, str]:
    """Per-second rate summed by labels; `what` names the series where a panel has several."""
    legend = " ".join([*(f"{{{{{label.strip()}}}}}" for label in by.split(",")), what]).strip()
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))", legend


def on_workers(dcgm_metric: str) -> str:
    """A DCGM exporter series of the selected pools' worker pods only, with their pool: the
    exporter labels each GPU with the pod that holds it (docs/observability.md)."""
    workers = f'up{{job="kvflow-worker", {SEL}}}'
    join = "on (namespace, pod) group_left (pool) group by (namespace, pod, pool)"
    return f"({dcgm_metric}) * {join} ({workers})"


GPU = "{{pod}} GPU {{gpu}}"


ROWS: dict[str, list[Panel]] = {
    "Gateway: what tenants see": [
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
    ],
    "GPUs (NVIDIA DCGM exporter), beside the latencies above": [
        Panel(
            "GPU utilisation",
            "percent",
            ((on_workers("DCGM_FI_DEV_GPU_UTIL"), GPU),),
            "Time the GPU ran a kernel (DCGM_FI_DEV_GPU_UTIL), per worker GPU. Low utilisation "
            "with high TPOT points at the host (scheduling, sampling), not the device.",
        ),
        Panel(
            "GPU memory",
            "decmbytes",
            (
                (on_workers("DCGM_FI_DEV_FB_USED"), GPU + " used"),
                (on_workers("DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE"), GPU + " total"),
            ),
            "Framebuffer used and total (MiB, DCGM), every process on the GPU; "
            "KvflowGPUMemoryFull alerts near full.",
        ),
        Panel(
            "Worker device memory by part",
            "bytes",
            (
                (
                    "sum by (pod, part) (kvflow_worker_device_memory_bytes{" + SEL + "})",
                    "{{pod}} {{part}}",
                ),
            ),
            "The worker's own split (its /metrics): weights, KV cache, CUDA graphs, and the "
            "rest of torch's allocator.",
            stack=True,
        ),
        Panel(
            "GPU power",
            "watt",
            ((on_workers("DCGM_FI_DEV_POWER_USAGE"), GPU),),
            "Board power draw (DCGM_FI_DEV_POWER_USAGE).",
        ),
        Panel(
            "GPU XID errors",
            "short",
            ((on_workers("DCGM_FI_DEV_XID_ERRORS"), GPU),),
            "The last XID the driver reported for the GPU (0: none); KvflowGPUXidError alerts "
            "on any.",
        ),
    ],
    "Overload and deadlines": [
        Panel(
            "Shed by admission control",
            "reqps",
            (rate("kvflow_router_admission_rejections_total", "code, reason"),),
            "Refused at the gateway before any worker saw them: 429 to a tenant over its "
            "share, 503 when the estimated queue is over the max or every queue is full. "
            "KvflowShedding alerts on the 503s.",
            stack=True,
        ),
        Panel(
            "Refused by workers",
            "reqps",
            (
                rate("kvflow_router_worker_rejections_total", "worker", "(gateway)"),
                rate("kvflow_worker_requests_rejected_total", "reason", "(workers)"),
            ),
            "RESOURCE_EXHAUSTED answers: per worker as the gateways see them, and by reason "
            "as the workers count them (queue_full: --max-waiting-requests; queue_time: "
            "--max-queue-time-s).",
        ),
        Panel(
            "Deadline misses",
            "short",
            (rate("kvflow_router_deadline_misses_total", "kind"),),
            "Streams cancelled for no first token (then failed over) or no next token "
            "(then ended with an error), per second. KvflowDeadlineMisses alerts.",
        ),
    ],
    "Protection": [
        Panel(
            "Pool circuits",
            "short",
            (("max by (pool) (kvflow_router_pool_circuit_state{" + SEL + "})", "{{pool}}"),),
            "A pool's circuit breaker, the worst of the gateway replicas: 0 closed, 1 half-open "
            "(probes only), 2 open (its requests get 503 at once). KvflowPoolCircuitOpen "
            "alerts (docs/router.md, Circuit breaker).",
        ),
        Panel(
            "Worker circuits",
            "short",
            (
                (
                    "max by (pool, worker) (kvflow_router_worker_circuit_state{" + SEL + "})",
                    "{{pool}} {{worker}}",
                ),
            ),
            "Each worker's circuit, the worst of the gateway replicas: 0 closed, 1 half-open, "
            "2 open (routed nothing).",
        ),
        Panel(
            "Circuit transitions",
            "short",
            (
                (
                    "sum by (scope, from_state, to_state) (rate("
                    "kvflow_router_circuit_transitions_total{" + SEL + "}" + RATE + "))",
                    "{{scope}} {{from_state}} -> {{to_state}}",
                ),
            ),
            "State changes per second of the workers' circuits (scope worker) and the pools' "
            "own (scope pool). KvflowWorkerCircuitFlapping alerts on many opens an hour.",
        ),
        Panel(
            "Degradation level by model",
            "short",
            (("max by (model) (kvflow_router_degradation_level{" + SEL + "})", "{{model}}"),),
            "Steps of the model's degradation ladder in force (0: none), the most of the "
            "gateway replicas. KvflowModelDegraded alerts after 15 minutes above 0 "
            "(docs/router.md, When demand exceeds supply).",
        ),
        Panel(
            "Degradation steps",
            "short",
            (rate("kvflow_router_degradation_transitions_total", "model, step, action"),),
            "Ladder steps taken (engaged) and reverted (released) per second, by model.",
        ),
        Panel(
            "429s by limit level",
            "reqps",
            (rate("kvflow_router_limit_rejections_total", "level, limit"),),
            "Refused by a limit of a client address, a model or the whole gateway "
            "(docs/router.md, Limits at four levels); the tenants' own are under Tenants. "
            "KvflowGlobalLimitRejections alerts on the global level.",
            stack=True,
        ),
        Panel(
            "Requests by priority class",
            "reqps",
            (rate("kvflow_router_priority_class_requests_total", "priority_class"),),
            "Finished requests by the class they ran as (docs/router.md, Priority classes).",
            stack=True,
        ),
        Panel(
            "Rejections by priority class",
            "reqps",
            (rate("kvflow_router_priority_class_rejections_total", "priority_class, reason"),),
            "Admission control's refusals by class and why: batch is shed first, then normal; "
            "realtime never (KvflowRealtimeRejected alerts if it is).",
            stack=True,
        ),
        Panel(
            "Worker preemptions by victim class",
            "reqps",
            (rate("kvflow_worker_class_preemptions_total", "victim_class"),),
            "Requests preempted on the workers, by the preempted request's class: batch "
            "preempted while realtime is not is the classes at work.",
            stack=True,
        ),
        Panel(
            "Response cache hit ratio",
            "percentunit",
            (
                (
                    "sum by (pool) (rate(kvflow_router_response_cache_lookups_total{"
                    + SEL
                    + ', result="hit"}'
                    + RATE
                    + ")) / sum by (pool) (rate(kvflow_router_response_cache_lookups_total{"
                    + SEL
                    + ', result=~"hit|miss"}'
                    + RATE
                    + "))",
                    "{{pool}} hits / (hits + misses)",
                ),
                (
                    "sum by (pool) (rate(kvflow_router_response_cache_lookups_total{"
                    + SEL
                    + ', result="bypass"}'
                    + RATE
                    + ")) / sum by (pool) (rate(kvflow_router_response_cache_lookups_total{"
                    + SEL
                    + "}"
                    + RATE
                    + "))",
                    "{{pool}} bypassed",
                ),
            ),
            "Cacheable requests answered from the response cache, and the share of all "
            "requests that skipped it (a header, sampling, a tenant's setting).",
        ),
        Panel(
            "Cascade outcomes",
            "reqps",
            (rate("kvflow_router_cascade_total", "model, outcome"),),
            "Requests of a cascaded model answered by the small model, or escalated to the "
            "large one and why.",
            stack=True,
        ),
        Panel(
            "Cascade escalated share",
            "percentunit",
            (
                (
                    "1 - sum by (model) (rate(kvflow_router_cascade_total{"
                    + SEL
                    + ', outcome="answered_small"}'
                    + RATE
                    + ")) / sum by (model) (rate(kvflow_router_cascade_total{"
                    + SEL
                    + "}"
                    + RATE
                    + "))",
                    "{{model}}",
                ),
            ),
            "The share of a cascaded model's requests the large model answered: what the "
            "cascade costs beyond the small model.",
        ),
    ],
    "Tenants": [
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
    ],
    "Prefill/decode disaggregation": [
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
    ],
    "Workers": [
        Panel(
            "KV cache usage",
            "percentunit",
            (("kvflow_worker_kv_cache_usage_ratio{" + SEL + "}", "{{pod}}"),),
            "Blocks held by requests; KvflowKVCacheNearlyFull alerts near 1.",
        ),
        Panel(
            "Requests running and waiting",
            "short",
            (
                ("sum by (pool) (kvflow_worker_requests_running{" + SEL + "})", "{{pool}} running"),
                ("sum by (pool) (kvflow_worker_requests_waiting{" + SEL + "})", "{{pool}} waiting"),
            ),
            "KvflowQueueGrowing alerts when waiting keeps growing.",
        ),
        Panel(
            "Queue wait",
            "s",
            quantiles("kvflow_worker_queue_wait_seconds"),
            "Arrival at the worker to its first scheduled chunk.",
        ),
        Panel(
            "Worker TTFT, TPOT, ITL (P99)",
            "s",
            (
                p99("kvflow_worker_time_to_first_token_seconds", "TTFT P99"),
                p99("kvflow_worker_time_per_output_token_seconds", "TPOT P99"),
                p99("kvflow_worker_inter_token_latency_seconds", "ITL P99"),
            ),
            "Inside the engine (no routing, no network): compare with the gateway's.",
        ),
        Panel(
            "Tokens",
            "short",
            (
                rate("kvflow_worker_generation_tokens_total", "pool", "generated"),
                rate("kvflow_worker_prompt_tokens_total", "pool", "prompt"),
            ),
            "Generated and prompt tokens per second.",
        ),
        Panel(
            "Prefix cache hit ratio",
            "percentunit",
            (
                (
                    f"{rate('kvflow_worker_prefix_cache_hit_tokens_total', 'pool')[0]}"
                    f" / {rate('kvflow_worker_prefix_cache_queried_tokens_total', 'pool')[0]}",
                    "{{pool}}",
                ),
            ),
            "Prompt tokens found in the cache / looked up.",
        ),
        Panel(
            "Finished and preempted",
            "reqps",
            (
                rate("kvflow_worker_requests_finished_total", "finish_reason"),
                rate("kvflow_worker_preemptions_total", "pool", "preempted"),
            ),
        ),
        Panel(
            "Engine step",
            "s",
            quantiles("kvflow_worker_step_duration_seconds"),
            "One engine step (a batch's forward pass and sampling).",
        ),
        Panel(
            "Scrape targets up",
            "short",
            (('sum by (job) (up{job=~"kvflow-router|kvflow-worker", ' + SEL + "})", "{{job}}"),),
            "KvflowWorkerDown and KvflowGatewayDown alert on up == 0.",
        ),
    ],
}
