"""The 429 of a level's limit: OpenAI's body, Retry-After, and a header naming the limit."""

from __future__ import annotations

from urllib.parse import quote

from kvflow.router.limits.decide import Refusal
from kvflow.router.protocol.errors import ApiError, rate_limited

LIMIT_HEADER = "x-kvflow-limit"  # model/llama/max_in_flight, global/tokens_per_minute, ...
_ERROR_TYPES = {"requests_per_minute": "requests", "tokens_per_minute": "tokens",
                "max_in_flight": "requests"}  # fmt: skip
_WHO = {"client_ip": "client address", "model": "model", "global": "gateway"}


class LimitExceededError(ApiError):
    def __init__(self, refusal: Refusal) -> None:
        slot = refusal.slot
        who = _WHO[slot.level] + (f" '{slot.key}'" if slot.key else "")
        base = rate_limited(
            f"Rate limit reached for the {who}: {refusal.kind.replace('_', ' ')} "
            f"(limit {refusal.limit_name}). Retry after {refusal.retry_after_s:.1f} s.",
            retry_after_s=refusal.retry_after_s,
            kind=_ERROR_TYPES[refusal.kind],
        )
        super().__init__(base.status, base.message, type=base.type, code=base.code,
                         retry_after_s=base.retry_after_s)  # fmt: skip
        self.limit_name = refusal.limit_name

    def headers(self) -> dict[str, str]:
        # A model name may hold what a header cannot: escaped, as in a URL.
        return {**super().headers(), LIMIT_HEADER: quote(self.limit_name, safe="/:.@_-")}


def limit_exceeded(refusal: Refusal) -> LimitExceededError:
    return LimitExceededError(refusal)
