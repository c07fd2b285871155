"""The workers row: KV cache, queues, per-worker latencies, tokens, prefix hits,
preemptions, engine steps and scrape targets."""

from __future__ import annotations

from dashboard_query import SEL, Panel, p99, quantiles, rate

TITLE = "Workers"

PANELS: list[Panel] = [
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
]
