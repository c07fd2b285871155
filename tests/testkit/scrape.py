"""Read one sample from a real process's Prometheus /metrics, by name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sample(url: str, name: str, **labels: str) -> float:
    """The sum of the series ``name`` whose labels include ``labels`` at ``url`` (a /metrics
    page); 0 when it has none (a counter with labels not incremented yet)."""
    text = httpx.get(url, timeout=10).text
    return sum(
        float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
