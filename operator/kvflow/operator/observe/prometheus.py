"""Ask a Prometheus one instant query over its HTTP API (I/O only; `promql` builds the
query and reads the answer).

Every way it can fail is one `PrometheusError` whose message says what happened (refused,
timed out, not Prometheus, a query error): the planner then holds replicas and writes the
message into the pool's status (reason PrometheusUnavailable), it never decides blind.
"""

from __future__ import annotations

import json

import aiohttp

from kvflow.operator.observe.http_body import read_body

QUERY_TIMEOUT_S = 5.0
# The planner's answer is ~30 series per histogram per target: 1 MB is hundreds of pods.
MAX_BODY_BYTES = 16 << 20


# The errorType values of the Prometheus HTTP API.
ERROR_TYPES = frozenset(
    {"bad_data", "timeout", "canceled", "execution", "internal", "unavailable", "not_found"}
)


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
            body = await read_body(response, MAX_BODY_BYTES)
            status = response.status
    except TimeoutError as exc:
        raise PrometheusError(f"{url}: no answer within {timeout_s:g} s") from exc
    except aiohttp.ClientError as exc:
        # The client's text (refused, DNS, TLS); its class name when it has none.
        raise PrometheusError(f"{url}: {str(exc)[:200] or type(exc).__name__}") from exc
    if body is None:
        raise PrometheusError(f"{url}: HTTP {status}, an answer over {MAX_BODY_BYTES} bytes")
    try:
        answer = json.loads(body)
    except ValueError as exc:
        raise PrometheusError(f"{url}: HTTP {status}, not a Prometheus API answer") from exc
    if not isinstance(answer, dict):
        raise PrometheusError(f"{url}: HTTP {status}, not a Prometheus API answer")
    if answer.get("status") != "success":
        # Only Prometheus' own error types are named: the rest of the answer is the
        # address's text, which never goes into status (it may be anything it serves).
        kind = answer.get("errorType")
        known = kind if kind in ERROR_TYPES else "an error"
        raise PrometheusError(f"{url}: HTTP {status}, {known} (see the Prometheus logs)")
    return answer.get("data")
