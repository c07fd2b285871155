"""The metric families one component exports and another reads: the workers' and the
routers' latency, load and refusal families that the operator's planner and status read
(operator/observe/). One spelling here; the exporters and the reader both use it.

The workers' request families (`CLASS_FAMILIES`) carry a `priority_class` label
(kvflow.proto.priority_class): the planner sizes for the online classes only and drops the
batch series, since batch work fills spare capacity and is preempted when online work needs
it (docs/planner.md, "Batch work"). A reader that wants every class sums over the label.
"""

from __future__ import annotations

WORKER_TTFT = "kvflow_worker_time_to_first_token_seconds"
WORKER_TPOT = "kvflow_worker_time_per_output_token_seconds"
WORKER_QUEUE_WAIT = "kvflow_worker_queue_wait_seconds"
WORKER_FINISHED = "kvflow_worker_requests_finished"
WORKER_PROMPT_TOKENS = "kvflow_worker_prompt_tokens"
WORKER_GENERATION_TOKENS = "kvflow_worker_generation_tokens"
WORKER_RUNNING = "kvflow_worker_requests_running"
WORKER_WAITING = "kvflow_worker_requests_waiting"
WORKER_KV_USAGE = "kvflow_worker_kv_cache_usage_ratio"
# The share of the KV cache's blocks each class's requests hold (a block two classes share
# counts for both): the whole cache's fill is WORKER_KV_USAGE.
WORKER_KV_CLASS_USAGE = "kvflow_worker_kv_cache_class_usage_ratio"

CLASS_LABEL = "priority_class"
CLASS_FAMILIES = frozenset(
    {
        WORKER_TTFT, WORKER_TPOT, WORKER_QUEUE_WAIT, WORKER_FINISHED, WORKER_PROMPT_TOKENS,
        WORKER_GENERATION_TOKENS, WORKER_RUNNING, WORKER_WAITING, WORKER_KV_CLASS_USAGE,
    }
)  # fmt: skip
"""The worker families labelled by `CLASS_LABEL`, one series per class."""

ROUTER_TTFT = "kvflow_router_ttft_seconds"
ROUTER_TPOT = "kvflow_router_tpot_seconds"
ROUTER_SHED = "kvflow_router_admission_rejections"  # a counter: samples end in _total
