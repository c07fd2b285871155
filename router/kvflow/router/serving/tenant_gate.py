"""A tenant's concurrency limit, checked before any work for its request.

The quota store (tenants/) decides ``max_concurrent_requests`` when a request is admitted,
which needs its prompt tokens: after the template and the tokenizer ran. A tenant that
already has that many requests in flight at this replica would be refused there anyway,
so it is refused here first (429, Retry-After 1 s as the store says it), before its
prompts cost anything. The count is this replica's, from before preparing to the end of
the response; the store, which counts every replica, still decides the rest.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvflow.router.protocol.errors import ApiError, rate_limited
from kvflow.router.tenants.config import Tenant

# As the quota stores answer a concurrency refusal.
RETRY_AFTER_S = 1.0


class TenantGate:
    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def num_in_flight(self, tenant_name: str) -> int:
        return self._in_flight[tenant_name]

    def enter(self, tenant: Tenant) -> Callable[[], None]:
        """Count one more of ``tenant``'s requests; the returned function (idempotent) ends
        it. Raises the 429 when the tenant is already at its limit here."""
        limit = tenant.quotas.max_concurrent_requests
        name = tenant.name
        if limit is not None and self._in_flight[name] >= limit:
            raise concurrency_exceeded(tenant, limit)
        self._in_flight[name] += 1
        is_done = False

        def leave() -> None:
            nonlocal is_done
            if is_done:
                return
            is_done = True
            self._in_flight[name] -= 1
            if self._in_flight[name] <= 0:
                del self._in_flight[name]

        return leave


def concurrency_exceeded(tenant: Tenant, limit: int) -> ApiError:
    return rate_limited(
        f"Rate limit reached for tenant '{tenant.name}': max concurrent requests ({limit} in "
        f"flight). Retry after {RETRY_AFTER_S:.1f} s.",
        retry_after_s=RETRY_AFTER_S,
        kind="requests",
    )
