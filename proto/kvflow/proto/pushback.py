"""gRFC A6's server pushback, the contract between a worker that refuses a request for now
and the router that retries it: the refusal's trailing metadata carries the milliseconds
until the caller should try that worker again."""

from __future__ import annotations

from collections.abc import Iterable

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


def pushback_metadata(retry_after_s: float) -> tuple[tuple[str, str]]:
    """The trailing metadata of a refusal: retry after ``retry_after_s`` seconds."""
    return ((RETRY_PUSHBACK_KEY, str(round(retry_after_s * 1000))),)


def pushback_s(metadata: Iterable[tuple[str, str | bytes]]) -> float | None:
    """The pushback in seconds from a call's trailing metadata; None when it has none or
    its value is not a whole number of milliseconds (gRFC A6: then no pushback)."""
    for key, value in metadata:
        if key == RETRY_PUSHBACK_KEY:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None
