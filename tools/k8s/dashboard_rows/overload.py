"""The overload row: requests shed by admission control, refused by workers, or past their
deadline."""

from __future__ import annotations

from dashboard_query import Panel, rate

TITLE = "Overload and deadlines"

PANELS: list[Panel] = [
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
]
