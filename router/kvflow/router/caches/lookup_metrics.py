"""The counters both caches keep of their lookups (caches/service.py, the exact one;
caches/semantic_service.py, the semantic one): each request by what the cache did, and
each bypass by why. Every series starts at zero, so a rate over it exists before the first
request and a dashboard shows 0, not "no data"."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter

LOOKUP_RESULTS = ("hit", "miss", "bypass")


class LookupCounters:
    def __init__(
        self,
        registry: CollectorRegistry,
        prefix: str,
        *,
        lookups_help: str,
        bypasses_help: str,
        bypass_reasons: Iterable[str],
    ) -> None:
        self.lookups = Counter(prefix + "lookups", lookups_help, ["result"], registry=registry)
        self.bypasses = Counter(prefix + "bypasses", bypasses_help, ["reason"], registry=registry)
        for result in LOOKUP_RESULTS:
            self.lookups.labels(result)
        for reason in bypass_reasons:
            self.bypasses.labels(reason)

    def count_bypass(self, reason: str) -> None:
        self.lookups.labels("bypass").inc()
        self.bypasses.labels(reason).inc()
