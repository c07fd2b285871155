"""The protection row: circuits, degradation, rate limits, priority classes, the response
cache and the cascade."""

from __future__ import annotations

from dashboard_query import RATE, SEL, Panel, rate

TITLE = "Protection"

PANELS: list[Panel] = [
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
]
