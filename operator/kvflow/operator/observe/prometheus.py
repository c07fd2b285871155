"""Ask a Prometheus one instant query over its HTTP API (I/O only; `promql` builds the
query and reads the answer).

Every way it can fail is one `PrometheusError` whose message says what happened (refused,
timed out, not Prometheus, a query error): the planner then holds replicas and writes the
message into the pool's status (reason PrometheusUnavailable), it never decides blind.
"""

from __future__ import annotations

import json

import aiohttp

QUERY_TIMEOUT_S = 5.0
# The planner's answer is ~30 series per histogram per target: 1 MB is hundreds of pods.
MAX_BODY_BYTES = 16 << 20


class PrometheusError(Exception):
    """The query got no usable answer; str() is for the pool's status."""


async def instant_query(base_url: str, query: str, timeout_s: float = QUERY_TIMEOUT_S) -> object:
    """The `data` of POST <base_url>/api/v1/query (evaluated now)."""
    url = base_url.rstrip("/") + "/api/v1/query"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, data={"query": query}) as response,
        ):
            body = await response.content.read(MAX_BODY_BYTES)
            status = response.status
    except TimeoutError as exc:
        raise PrometheusError(f"{url}: no answer within {timeout_s:g} s") from exc
    except aiohttp.ClientError as exc:
        raise PrometheusError(f"{url}: {exc or type(exc).__name__}") from exc
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise PrometheusError(f"{url}: HTTP {status}, not a Prometheus API answer") from exc
    if not isinstance(answer, dict):
        raise PrometheusError(f"{url}: HTTP {status}, not a Prometheus API answer")
    if answer.get("status") != "success":
        kind, error = answer.get("errorType", "error"), answer.get("error", "")
        raise PrometheusError(f"{url}: HTTP {status}, {kind}: {str(error)[:300]}")
    return answer.get("data")
