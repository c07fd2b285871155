"""Who reaches the pools' metrics ports: the namespaces the operator's administrator names
and the operator's own, never any pod by default (pure builders and the operator's flags;
tests/k8s/test_secure_defaults.py applies them to a real API server)."""

from __future__ import annotations

import pytest
from testkit.pool_spec import IMAGES, POOL, spec_of

from kvflow.operator.admin_policy import AdminPolicy, setting_problems
from kvflow.operator.api.schema import Json
from kvflow.operator.builders.desired import ChildKey, desired_children
from kvflow.operator.builders.gateway import GatewayRef, gateway_network_policy
from kvflow.operator.builders.network import MetricsScrapers
from kvflow.operator.cli import metrics_scrapers, parse_args

WORKERS = ChildKey("networking.k8s.io/v1", "NetworkPolicy", "p-workers")
ROUTER = ChildKey("networking.k8s.io/v1", "NetworkPolicy", "p-router")


def policies(scrapers: MetricsScrapers) -> dict[ChildKey, dict[str, Json]]:
    children = desired_children(POOL, spec_of(), IMAGES, scrapers=scrapers)
    return {ChildKey.of(c): c for c in children if c["kind"] == "NetworkPolicy"}


def rules_for_port(policy: dict[str, Json], port: int) -> list[dict[str, Json]]:
    return [r for r in policy["spec"]["ingress"]
            if {"protocol": "TCP", "port": port} in r.get("ports", [])]  # fmt: skip


def peer(namespace: str) -> dict[str, Json]:
    return {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "podSelector": {},
    }


def test_by_default_no_pod_reaches_a_metrics_port() -> None:
    got = policies(MetricsScrapers())
    assert rules_for_port(got[WORKERS], 9400) == []
    assert rules_for_port(got[ROUTER], 9401) == []
    # Requests still come in from anywhere: the router authenticates them.
    assert rules_for_port(got[ROUTER], 8000) == [{"ports": [{"protocol": "TCP", "port": 8000}]}]


def test_named_namespaces_reach_the_metrics_ports_and_no_other_port() -> None:
    got = policies(MetricsScrapers(("kvflow-system", "monitoring")))
    for key, port in ((WORKERS, 9400), (ROUTER, 9401)):
        (rule,) = rules_for_port(got[key], port)
        assert rule == {
            "from": [peer("kvflow-system"), peer("monitoring")],
            "ports": [{"protocol": "TCP", "port": port}],
        }
    # Those namespaces reach neither worker gRPC nor the KV port.
    for rule in got[WORKERS]["spec"]["ingress"]:
        if peer("monitoring") in rule.get("from", []):
            assert rule["ports"] == [{"protocol": "TCP", "port": 9400}]


def test_any_namespace_opens_the_metrics_ports_to_every_pod() -> None:
    got = policies(MetricsScrapers(any_namespace=True))
    assert rules_for_port(got[WORKERS], 9400) == [{"ports": [{"protocol": "TCP", "port": 9400}]}]
    assert rules_for_port(got[ROUTER], 9401) == [{"ports": [{"protocol": "TCP", "port": 9401}]}]


def test_a_gateways_routers_follow_the_same_rule() -> None:
    gateway = GatewayRef(name="front", namespace="ns", uid="uid-g")
    closed = gateway_network_policy(gateway)
    assert rules_for_port(closed, 9401) == []
    scoped = gateway_network_policy(gateway, MetricsScrapers(("monitoring",)))
    assert rules_for_port(scoped, 9401)[0]["from"] == [peer("monitoring")]


def test_the_operators_own_namespace_always_scrapes_and_star_means_any(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert metrics_scrapers([], None) == MetricsScrapers()
    assert metrics_scrapers([], "kvflow-system") == MetricsScrapers(("kvflow-system",))
    assert metrics_scrapers(["monitoring", "kvflow-system"], "kvflow-system") == (
        MetricsScrapers(("kvflow-system", "monitoring"))
    )
    assert metrics_scrapers(["*"], "kvflow-system") == MetricsScrapers(
        ("kvflow-system",), any_namespace=True
    )
    monkeypatch.setenv("POD_NAMESPACE", "ops")
    args = parse_args(["--metrics-scraper-namespace", "monitoring"])
    assert args.metrics_scraper_namespaces == ["monitoring"]


def test_a_name_that_is_no_namespace_is_refused_at_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = AdminPolicy(metrics_scrapers=MetricsScrapers(("Monitoring_NS",)))
    assert setting_problems(bad) == [
        "--metrics-scraper-namespace 'Monitoring_NS' is not a namespace name (or '*' for any)"
    ]
    with pytest.raises(SystemExit):
        parse_args(["--metrics-scraper-namespace", "Monitoring_NS"])
    assert "is not a namespace name" in capsys.readouterr().err
