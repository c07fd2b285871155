"""Per-request usage: summed over choices, settled with quotas and metrics exactly once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvflow.router.api.gateway import Gateway
from kvflow.router.protocol.responses import UsageCounts
from kvflow.router.serving.types import ChoiceUsage, RequestTrace
from kvflow.router.tenants.config import Tenant
from kvflow.router.tenants.service import Lease
from kvflow.router.tenants.store import UsageTotals


@dataclass
class Accounting:
    """Sums usage over choices and settles the request's quota lease exactly once."""

    gateway: Gateway
    tenant: Tenant
    lease: Lease
    trace: RequestTrace
    _prompt: dict[int, UsageCounts] = field(default_factory=dict)
    completion_tokens: int = 0
    _is_finished: bool = False

    def add(self, item: ChoiceUsage) -> None:
        # OpenAI counts a prompt once however many choices it has.
        seen = self._prompt.setdefault(item.prompt_index, UsageCounts())
        seen.prompt_tokens = max(seen.prompt_tokens, item.usage.prompt_tokens)
        seen.cached_tokens = max(seen.cached_tokens, item.usage.cached_tokens)
        self.completion_tokens += item.usage.completion_tokens

    @property
    def usage(self) -> UsageCounts:
        return UsageCounts(
            prompt_tokens=sum(u.prompt_tokens for u in self._prompt.values()),
            completion_tokens=self.completion_tokens,
            cached_tokens=sum(u.cached_tokens for u in self._prompt.values()),
        )

    async def finish(self) -> None:
        if self._is_finished:
            return
        self._is_finished = True
        usage = self.usage
        name, metrics = self.tenant.name, self.gateway.metrics
        metrics.tenant_requests.labels(name).inc()
        metrics.tenant_prompt_tokens.labels(name).inc(usage.prompt_tokens)
        metrics.tenant_completion_tokens.labels(name).inc(usage.completion_tokens)
        metrics.tenant_cached_tokens.labels(name).inc(usage.cached_tokens)
        finished_s = time.perf_counter()
        metrics.e2e_s.observe(finished_s - self.trace.arrival_s)
        first_token_s = self.trace.first_token_s
        if first_token_s is not None and usage.completion_tokens >= 2:
            metrics.tpot_s.observe((finished_s - first_token_s) / (usage.completion_tokens - 1))
        await self.gateway.quotas.finish(
            self.lease,
            UsageTotals(
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
            ),
        )
