"""One error type for everything a client can get wrong, in OpenAI's shape.

Raised anywhere in the gateway with the status and fields a client needs; the app maps it
to a JSON response once (api/errors.py). Anything else that escapes is our bug: a 500.
"""

from __future__ import annotations

import math
from typing import Any


class ApiError(Exception):
    """An error a client receives as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        # Retry-After is whole seconds; round up so a client that obeys it gets through.
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported_parameter(param: str, why: str = "is not supported by kvflow") -> ApiError:
    return ApiError(400, f"'{param}' {why}.", param=param, code="unsupported_parameter")


def invalid_api_key(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key")


def model_not_allowed(model: str) -> ApiError:
    return ApiError(
        403,
        f"This API key is not allowed to use the model '{model}'; ask the pool's administrator "
        "to add it to the tenant's models.",
        param="model",
        code="model_not_allowed",
    )


def model_not_found(model: str, served: list[str]) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist or you do not have access to it. "
        f"Models served here: {', '.join(served) or 'none'} (GET /v1/models).",
        param="model",
        code="model_not_found",
    )


def body_too_large(limit_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is larger than this gateway accepts ({limit_bytes} bytes).",
        code="request_too_large",
    )


def rate_limited(message: str, *, retry_after_s: float, kind: str) -> ApiError:
    """429. ``kind`` is OpenAI's error type: "requests", "tokens" or "insufficient_quota"."""
    return ApiError(
        429,
        message,
        type=kind,
        code="insufficient_quota" if kind == "insufficient_quota" else "rate_limit_exceeded",
        retry_after_s=retry_after_s,
    )


def no_worker_available(message: str, *, retry_after_s: float = 1.0) -> ApiError:
    return ApiError(
        503,
        message,
        type="server_error",
        code="service_unavailable",
        retry_after_s=retry_after_s,
    )


def circuit_open(pool: str, why: str, retry_after_s: float) -> ApiError:
    """503 at once, without queueing: the pool's circuit breaker is open."""
    return ApiError(
        503,
        f"The circuit breaker of pool '{pool}' is open: {why}. Its requests are refused "
        f"until it half-opens; retry in {max(1, math.ceil(retry_after_s))} s.",
        type="server_error",
        code="circuit_open",
        retry_after_s=retry_after_s,
    )


def worker_failed(message: str) -> ApiError:
    """A worker broke after the response had started, or every retry failed."""
    return ApiError(502, message, type="server_error", code="worker_error")
