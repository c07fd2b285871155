"""The dashboard's building blocks: the Panel record, the pool selector every query
carries, and the PromQL shapes (quantiles, rates, DCGM joins) the rows share.
"""

from __future__ import annotations

from dataclasses import dataclass

SEL = 'namespace=~"$namespace", pool=~"$pool"'
API = SEL + ', endpoint=~"/v1/.+"'  # probes and scrapes are not tenants' traffic
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""
    stack: bool = False


def quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    """P50, P90 and P99 of a histogram over the selected pools."""
    group = f"le, {by}" if by else "le"
    prefix = f"{{{{{by}}}}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL}}}{RATE})))",
            f"{prefix}P{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def p90_by_model(metric: str) -> tuple[tuple[str, str], ...]:
    """P90 per served model (the router's `model` label: the version that answered), so a
    canary's latency shows next to the version it may replace."""
    expr = f"histogram_quantile(0.9, sum by (le, model) (rate({metric}_bucket{{{SEL}}}{RATE})))"
    return ((expr, "{{model}}"),)


def p99(metric: str, legend: str) -> tuple[str, str]:
    return f"histogram_quantile(0.99, sum by (le) (rate({metric}_bucket{{{SEL}}}{RATE})))", legend


def rate(metric: str, by: str, what: str = "", selector: str = SEL) -> tuple[str, str]:
    """Per-second rate summed by labels; `what` names the series where a panel has several."""
    legend = " ".join([*(f"{{{{{label.strip()}}}}}" for label in by.split(",")), what]).strip()
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))", legend


def on_workers(dcgm_metric: str) -> str:
    """A DCGM exporter series of the selected pools' worker pods only, with their pool: the
    exporter labels each GPU with the pod that holds it (docs/observability.md)."""
    workers = f'up{{job="kvflow-worker", {SEL}}}'
    join = "on (namespace, pod) group_left (pool) group by (namespace, pod, pool)"
    return f"({dcgm_metric}) * {join} ({workers})"


GPU = "{{pod}} GPU {{gpu}}"
