"""The chart's monitoring (PodMonitors, PrometheusRule, Grafana dashboard) with the real
helm and the real promtool (built from the Prometheus Go module by tools/k8s/build.sh).

Every metric the dashboard and the alerts query must be one that the router or a worker
exports: the names come from the metrics classes themselves, so a renamed metric fails here
instead of leaving an empty panel or an alert that can never fire.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s.controlplane import (
    CHART,
    RELEASE,
    REPO,
    SYSTEM_NAMESPACE,
    Binaries,
    cache_dir,
    read_versions,
)
from prometheus_client.metrics import MetricWrapperBase

from kvflow.engine_worker.metrics import WorkerMetrics
from kvflow.router.breaker.machine import CircuitState
from kvflow.router.caches.service import ResponseCacheMetrics
from kvflow.router.cascade.config import CascadeSpec
from kvflow.router.cascade.service import Cascade
from kvflow.router.degrade.service import DegradationMetrics
from kvflow.router.metrics import RouterMetrics
from kvflow.router.routing.types import WorkerId

ALERTS_TEST = Path(__file__).parent / "observability" / "kvflow_alerts_test.yaml"
DASHBOARD = CHART / "dashboards" / "kvflow.json"
ALL_ON = [
    "--set", "monitoring.podMonitor.enabled=true",
    "--set", "monitoring.prometheusRule.enabled=true",
    "--set", "monitoring.dashboard.enabled=true",
]  # fmt: skip
ALERTS = {
    "KvflowTTFTP99High", "KvflowTPOTP99High", "KvflowErrorRateHigh", "KvflowNoHealthyWorkers",
    "KvflowGatewayDown", "KvflowWorkerDown", "KvflowKVCacheNearlyFull", "KvflowQueueGrowing",
    "KvflowShedding", "KvflowDeadlineMisses", "KvflowTenantsStale", "KvflowQuotaStoreDown",
    "KvflowGPUMemoryFull", "KvflowGPUXidError", "KvflowPoolCircuitOpen",
    "KvflowWorkerCircuitFlapping", "KvflowModelDegraded", "KvflowGlobalLimitRejections",
    "KvflowRealtimeRejected",
}  # fmt: skip
# NVIDIA DCGM exporter fields the alerts and the GPU panels query (its default counters,
# dcgm-exporter's etc/default-counters.csv): a typo would leave a panel empty.
DCGM_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS",
}  # fmt: skip
# Labels a series gets from the PodMonitors, not from the code (Prometheus adds instance).
TARGET_LABELS = {"job", "namespace", "pod", "pool", "role", "container", "instance"}
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


@pytest.fixture(scope="module")
def promtool() -> Path:
    """The cached promtool; a failing test, never a skip, when it was not built."""
    path = cache_dir() / f"promtool-{read_versions()['PROMETHEUS_VERSION']}" / "bin" / "promtool"
    assert path.exists(), f"{path} missing: build it with tools/k8s/build.sh (.ci/run does)"
    return path


def helm(binaries: Binaries, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **{f"HELM_{d}_HOME": str(tmp / d) for d in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run(
        [str(binaries.helm), *args], capture_output=True, text=True, env=env, timeout=120,
        check=False,
    )  # fmt: skip


def helm_template(binaries: Binaries, tmp: Path, *args: str) -> list[dict[str, Any]]:
    out = helm(
        binaries, tmp, "template", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE, *args
    )
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def rules_file(binaries: Binaries, tmp: Path, *args: str) -> Path:
    """The rendered PrometheusRule's spec, as a Prometheus rules file next to the unit test."""
    docs = helm_template(binaries, tmp, *ALL_ON, *args)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    shutil.copy(ALERTS_TEST, tmp / ALERTS_TEST.name)
    path = tmp / "kvflow-alerts.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def run_promtool(promtool: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(promtool), *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_monitoring_is_off_by_default(binaries: Binaries, tmp_path: Path) -> None:
    kinds = {d["kind"] for d in helm_template(binaries, tmp_path)}
    assert not kinds & {"PodMonitor", "PrometheusRule", "ConfigMap"}
    # The kvflow monitors on leave the DCGM exporter's off: it is a flag of its own.
    docs = helm_template(binaries, tmp_path, *ALL_ON)
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "PodMonitor"}
    assert names == {"kvflow-router", "kvflow-worker"}


def test_dcgm_exporter_pod_monitor(binaries: Binaries, tmp_path: Path) -> None:
    docs = helm_template(binaries, tmp_path, "--set", "monitoring.dcgmPodMonitor.enabled=true",
                         "--set", "monitoring.dcgmPodMonitor.labels.release=prom")  # fmt: skip
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["metadata"]["name"] == "kvflow-dcgm-exporter"
    assert monitor["metadata"]["namespace"] == SYSTEM_NAMESPACE
    assert monitor["metadata"]["labels"]["release"] == "prom"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": ["gpu-operator"]}
    assert spec["selector"] == {"matchLabels": {"app": "nvidia-dcgm-exporter"}}
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        "metrics",
        "/metrics",
        "15s",
    )
    # The GPU's own pod and namespace (the exporter's labels) must win over the target's.
    assert endpoint["honorLabels"] is True
    assert {"targetLabel": "job", "replacement": "dcgm-exporter"} in endpoint["relabelings"]
    # The standalone dcgm-exporter chart, in any namespace (null drops the default label).
    values = tmp_path / "dcgm.yaml"
    selector = {"app": None, "app.kubernetes.io/name": "dcgm-exporter"}
    values.write_text(yaml.safe_dump({"monitoring": {"dcgmPodMonitor": {
        "enabled": True, "namespaces": [], "selector": selector}}}))  # fmt: skip
    docs = helm_template(binaries, tmp_path, "-f", str(values))
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/name": "dcgm-exporter"}
    }


def test_helm_lint_strict_with_monitoring_on(binaries: Binaries, tmp_path: Path) -> None:
    out = helm(binaries, tmp_path, "lint", "--strict", str(CHART), *ALL_ON)
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


def test_values_schema_rejects_bad_monitoring_values(binaries: Binaries, tmp_path: Path) -> None:
    for bad, message in [
        ("monitoring.prometheusRule.errorRatio=2", "prometheusRule/errorRatio"),
        ("monitoring.prometheusRule.ttftP99Seconds=0", "prometheusRule/ttftP99Seconds"),
        ("monitoring.podMonitor.interval=fast", "podMonitor/interval"),
        ("monitoring.dashboard.namespace=Bad_NS", "dashboard/namespace"),
        ("monitoring.serviceMonitor.enabled=true", "serviceMonitor"),
        ("monitoring.prometheusRule.gpuMemoryRatio=1.5", "prometheusRule/gpuMemoryRatio"),
        ("monitoring.dcgmPodMonitor.interval=often", "dcgmPodMonitor/interval"),
        ("monitoring.dcgmPodMonitor.namespaces={Bad_NS}", "dcgmPodMonitor/namespaces"),
        (
            "monitoring.prometheusRule.globalLimitRejectionRatio=2",
            "prometheusRule/globalLimitRejectionRatio",
        ),
        (
            "monitoring.prometheusRule.workerCircuitOpensPerHour=-1",
            "prometheusRule/workerCircuitOpensPerHour",
        ),
        (
            "monitoring.prometheusRule.realtimeRejectionsPer10m=0.5",
            "prometheusRule/realtimeRejectionsPer10m",
        ),
    ]:
        out = helm(binaries, tmp_path, "template", RELEASE, str(CHART), "--set", bad)
        assert out.returncode != 0, bad
        assert message in out.stderr, (bad, out.stderr)


def test_pod_monitors_scrape_the_operators_pods(binaries: Binaries, tmp_path: Path) -> None:
    docs = helm_template(binaries, tmp_path, *ALL_ON, "--set", "operator.watchNamespaces={a,b}")
    monitors = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"kvflow-router", "kvflow-worker"}
    # Both scrape the operator's pods' container port named "metrics" (off the API port).
    for component, port in (("router", "metrics"), ("worker", "metrics")):
        spec = monitors[f"kvflow-{component}"]
        assert spec["namespaceSelector"] == {"matchNames": ["a", "b"]}
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec["jobLabel"] == "app.kubernetes.io/name"  # job="kvflow-<component>"
        (endpoint,) = spec["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == (port, "/metrics")
        targets = {r.get("targetLabel") for r in endpoint["relabelings"]}
        assert {"pool", "role"} <= targets
    # The gateway's requests_total has its own `endpoint` label; the target's must go.
    router_relabelings = monitors["kvflow-router"]["podMetricsEndpoints"][0]["relabelings"]
    assert {"action": "labeldrop", "regex": "endpoint"} in router_relabelings
    docs = helm_template(binaries, tmp_path, *ALL_ON)
    (spec, _) = [d["spec"] for d in docs if d["kind"] == "PodMonitor"]
    assert spec["namespaceSelector"] == {"any": True}


def test_dashboard_config_map_for_the_grafana_sidecar(binaries: Binaries, tmp_path: Path) -> None:
    docs = helm_template(
        binaries, tmp_path, *ALL_ON, "--set", "monitoring.dashboard.namespace=monitoring"
    )
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert json.loads(config_map["data"]["kvflow.json"]) == json.loads(DASHBOARD.read_text())


def test_dashboard_is_generated_and_well_formed() -> None:
    gen = subprocess.run(
        [sys.executable, str(REPO / "tools" / "k8s" / "gen_dashboard.py"), "--check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells)), "panels overlap"
    assert all(x < 24 for x, _ in cells)
    for panel in panels:
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_promtool_check_rules(binaries: Binaries, promtool: Path, tmp_path: Path) -> None:
    rules = rules_file(binaries, tmp_path)
    alerts = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
    assert alerts == ALERTS
    out = run_promtool(promtool, "check", "rules", "--lint=all", "--lint-fatal", str(rules))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_dashboard_queries_parse(promtool: Path, tmp_path: Path) -> None:
    """Each panel query, with Grafana's variables filled in, as a recording rule for
    promtool: a PromQL syntax error fails here, not on an operator's screen."""
    rules = [
        {"record": f"kvflow:panel_{i}", "expr": fill_grafana_variables(expr)}
        for i, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = run_promtool(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_unit_tests_fire_each_alert(
    binaries: Binaries, promtool: Path, tmp_path: Path
) -> None:
    rules_file(binaries, tmp_path)
    out = run_promtool(promtool, "test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert out.returncode == 0, out.stdout + out.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERTS_TEST.read_text()))
    assert tested == ALERTS


def test_promtool_unit_tests_see_a_wrong_threshold(
    binaries: Binaries, promtool: Path, tmp_path: Path
) -> None:
    """The unit tests assert what fires: a TTFT threshold above what "slow" reaches fails."""
    rules_file(binaries, tmp_path, "--set", "monitoring.prometheusRule.ttftP99Seconds=30")
    out = run_promtool(promtool, "test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert out.returncode != 0
    assert "KvflowTTFTP99High" in out.stdout + out.stderr


def test_every_queried_metric_is_exported_by_the_code(binaries: Binaries, tmp_path: Path) -> None:
    exported = exported_metrics()
    docs = helm_template(binaries, tmp_path, *ALL_ON)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    exprs += [fill_grafana_variables(e) for e in dashboard_exprs()]
    queried = {name for expr in exprs for name in re.findall(r"\bkvflow_\w+", expr)}
    dcgm = {name for expr in exprs for name in re.findall(r"\bDCGM_\w+", expr)}
    assert dcgm == DCGM_FIELDS, dcgm
    assert len(queried) > 30, queried
    unknown = sorted(name for name in queried if base_name(name, exported) is None)
    assert not unknown, f"queried but exported by no metrics class: {unknown}"
    for expr in exprs:
        for name, matchers in re.findall(r"\b(kvflow_\w+)\{([^}]*)\}", expr):
            base = base_name(name, exported)
            assert base is not None
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers))
            allowed = (
                exported[base][1] | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
            )
            assert used <= allowed, (name, used - allowed)


class _OnePool:
    """A pool of one worker for the circuit gauges, which read live pools at scrape time."""

    def circuit_state(self) -> CircuitState:
        return CircuitState.CLOSED

    def worker_circuits(self) -> dict[WorkerId, CircuitState]:
        return {WorkerId("10.0.0.1:50051"): CircuitState.CLOSED}


# Gauges a collector reads off live objects at scrape time (circuit_metrics.py), no
# attribute of a metrics class: their label names come from their samples.
COLLECTED_GAUGES = {"kvflow_router_pool_circuit_state", "kvflow_router_worker_circuit_state"}


def exported_metrics() -> dict[str, tuple[str, set[str]]]:
    """Base name -> (type, label names) of every metric the router and a worker export:
    the gateway's own classes and the ones its parts register in its registry (the
    circuit breakers', the degradation ladder's, the response cache's, the cascade's)."""
    found: dict[str, tuple[str, set[str]]] = {}
    router, worker = RouterMetrics(), WorkerMetrics()
    registry = router.registry
    cascade = CascadeSpec(model="m", names=frozenset({"m"}), small="m-small", large="m-large")
    owners = (
        router, router.circuits, worker, DegradationMetrics(registry, []),
        ResponseCacheMetrics(registry), Cascade({"m": cascade}, registry),
    )  # fmt: skip
    router.circuits.watch({"default": _OnePool()})
    for owner in owners:
        for metric in vars(owner).values():
            if isinstance(metric, MetricWrapperBase):
                # prometheus_client has no public accessor for a parent's label names.
                found[metric._name] = (metric._type, set(metric._labelnames))
    families = [m for r in (registry, worker.registry) for m in r.collect()]
    for family in families:
        if family.name in COLLECTED_GAUGES:
            labels = {name for sample in family.samples for name in sample.labels}
            found[family.name] = (family.type, labels)
    collected = {m.name for m in families}
    assert collected == set(found), "a registered metric that is no attribute of its class"
    assert collected >= COLLECTED_GAUGES, "the circuit gauges show no pool"
    return found


def base_name(name: str, exported: dict[str, tuple[str, set[str]]]) -> str | None:
    """The declared metric a series name belongs to (_total, _bucket, _sum, _count)."""
    for base, (kind, _) in exported.items():
        if any(name == base + suffix for suffix in SUFFIXES[kind]):
            return base
    return None


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    # label_values(<series selector>, <label>) is Grafana's, not PromQL: keep the selector.
    exprs += [re.sub(r"^label_values\((.*), \w+\)$", r"\1", q) for q in variables]
    assert exprs
    return exprs


def fill_grafana_variables(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$pool", ".*")
