"""What the operator's administrator allows pool authors to ask for, and who may scrape
the pools (pure).

A pool author can write any spec the CRD accepts, but some fields reach outside the pool's
namespace: a hostPath volume mounts a node's folder into worker and router pods, and
`autoscaling.prometheus.url` makes the operator itself send requests to an address. The
operator's administrator (who installs the chart) decides which ones are allowed; by
default none are. A spec asking for more is not applied: the pool is Degraded with a reason
that names the setting to change (`kvflow operator --allowed-host-path-prefix`,
`--allowed-prometheus-url`; the chart's `operator.allowedHostPathPrefixes` and
`operator.allowedPrometheusUrls`).

The pools' metrics ports admit the namespaces the administrator names
(`--metrics-scraper-namespace`, the chart's `operator.metricsScraperNamespaces`) and the
operator's own (builders/network.py).
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from kvflow.operator.api import v1alpha1, v1alpha1_model
from kvflow.operator.builders.network import NO_SCRAPERS, MetricsScrapers

HOST_PATH_SETTING = "--allowed-host-path-prefix (the chart's operator.allowedHostPathPrefixes)"
PROMETHEUS_SETTING = "--allowed-prometheus-url (the chart's operator.allowedPrometheusUrls)"
_DEFAULT_PORTS = {"http": 80, "https": 443}
# A namespace's name: a DNS-1123 label.
_NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


@dataclass(frozen=True)
class AdminPolicy:
    """The operator's settings; empty tuples allow nothing."""

    # Node folders (absolute) under which model.volume.hostPath may point.
    allowed_host_path_prefixes: tuple[str, ...] = ()
    # Prometheus base URLs (scheme, host, port, optional path) the planner may query.
    allowed_prometheus_urls: tuple[str, ...] = ()
    # Who may reach the workers' and routers' metrics ports (NetworkPolicies).
    metrics_scrapers: MetricsScrapers = NO_SCRAPERS


@dataclass(frozen=True)
class PolicyProblem:
    reason: Literal["HostPathNotAllowed", "PrometheusNotAllowed"]
    message: str


def host_path_allowed(path: str, prefixes: Sequence[str]) -> bool:
    """`path` lies at or under one of `prefixes`, compared folder by folder after
    normalizing, so `/models/../etc` is `/etc` and `/models-x` is not under `/models`."""
    if not path.startswith("/"):
        return False
    wanted = posixpath.normpath(path)
    for prefix in prefixes:
        root = posixpath.normpath(prefix)
        if root in ("/", wanted) or wanted.startswith(root + "/"):
            return True
    return False


def prometheus_url_allowed(url: str, allowed: Sequence[str]) -> bool:
    """`url` has the scheme, host and port of an allowed base URL, and its path is that
    URL's path or below it. Compared parsed, not as text: `http://prom:9090@evil` (a user
    name) or `http://prom:90901` never pass for `http://prom:9090`."""
    got = _parse(url)
    if got is None:
        return False
    for entry in allowed:
        base = _parse(entry)
        if base is None or base[:3] != got[:3]:
            continue
        root = base[3].rstrip("/")
        path = got[3].rstrip("/")
        if path == root or path.startswith(root + "/"):
            return True
    return False


def setting_problems(policy: AdminPolicy) -> list[str]:
    """Entries of the administrator's settings that could never match (checked at start)."""
    problems = [
        f"--allowed-host-path-prefix {p!r} is not an absolute folder"
        for p in policy.allowed_host_path_prefixes
        if not p.startswith("/")
    ]
    problems += [
        f"--allowed-prometheus-url {u!r} is not an http(s) base URL without user info, "
        "query or fragment"
        for u in policy.allowed_prometheus_urls
        if _parse(u) is None
    ]
    problems += [
        f"--metrics-scraper-namespace {n!r} is not a namespace name (or '*' for any)"
        for n in policy.metrics_scrapers.namespaces
        if not _NAMESPACE_NAME.fullmatch(n)
    ]
    return problems


def _parse(url: str) -> tuple[str, str, int, str] | None:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        return None
    path = posixpath.normpath(parts.path) if parts.path else ""
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme], path.rstrip("/")


def host_path_problems(
    where: str, model: v1alpha1_model.ModelSpec, policy: AdminPolicy
) -> list[PolicyProblem]:
    volume = model.volume
    if volume is None or volume.host_path is None:
        return []
    path = volume.host_path.path
    if host_path_allowed(path, policy.allowed_host_path_prefixes):
        return []
    allowed = ", ".join(policy.allowed_host_path_prefixes) or "none"
    return [
        PolicyProblem(
            "HostPathNotAllowed",
            f"{where}model.volume.hostPath {path} is not under a folder the operator allows "
            f"(allowed: {allowed}); use a persistentVolumeClaim, or ask the operator's "
            f"administrator to allow it with {HOST_PATH_SETTING}",
        )
    ]


def prometheus_problems(
    spec: v1alpha1.InferencePoolSpec, policy: AdminPolicy
) -> list[PolicyProblem]:
    source = spec.autoscaling.prometheus
    if source is None or prometheus_url_allowed(source.url, policy.allowed_prometheus_urls):
        return []
    return [PolicyProblem("PrometheusNotAllowed", prometheus_refusal(source.url, policy))]


def prometheus_refusal(url: str, policy: AdminPolicy) -> str:
    allowed = ", ".join(policy.allowed_prometheus_urls) or "none"
    return (
        f"autoscaling.prometheus.url {url[:200]} is not a Prometheus the operator may query "
        f"(allowed: {allowed}); ask the operator's administrator to allow it with "
        f"{PROMETHEUS_SETTING}"
    )


def pool_policy_problems(
    spec: v1alpha1.InferencePoolSpec, policy: AdminPolicy
) -> list[PolicyProblem]:
    """Everything in a pool's spec that the administrator does not allow."""
    return host_path_problems("", spec.model, policy) + prometheus_problems(spec, policy)
