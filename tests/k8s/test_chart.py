"""The Helm chart with the real helm binary: lint, template, schema, install."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import yaml
from k8s.controlplane import CHART, RELEASE, REPO, SYSTEM_NAMESPACE, Binaries, ControlPlane

from kvflow.operator.kube import CLUSTER_RULES, LEASE_RULES, NAMESPACED_RULES, RBAC_RULES


def render(cluster: ControlPlane, *args: str) -> list[dict[str, Any]]:
    out = cluster.helm("template", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE, *args)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_helm_lint_strict_is_clean(cluster: ControlPlane) -> None:
    examples = ["--set", "examplePool.enabled=true", "--set", "exampleGateway.enabled=true"]
    for values in ([], ["--set", "redis.enabled=true", *examples]):
        out = cluster.helm("lint", "--strict", str(CHART), *values)
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout


def test_chart_crds_are_the_generated_ones(binaries: Binaries) -> None:
    crd_files = sorted((REPO / "crds").glob("*.yaml"))
    assert [f.name for f in crd_files] == [
        "inferencegateways.kvflow.io.yaml",
        "inferencemodels.kvflow.io.yaml",
        "inferencepools.kvflow.io.yaml",
    ]
    assert sorted(f.name for f in (CHART / "crds").glob("*.yaml")) == [f.name for f in crd_files]
    for crd_file in crd_files:
        assert (CHART / "crds" / crd_file.name).read_text() == crd_file.read_text()


def test_template_renders_the_operator_and_least_privilege_rbac(cluster: ControlPlane) -> None:
    docs = render(cluster)
    assert sorted(d["kind"] for d in docs) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding",
        "ServiceAccount",
    ]  # fmt: skip
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == RBAC_RULES  # exactly what kvflow.operator.kube calls
    (role,) = by_kind(docs, "Role")
    assert role["rules"] == LEASE_RULES
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/kvflow/operator:0.1.0"
    assert container["command"] == ["kvflow", "operator"]
    assert "--worker-image=ghcr.io/kvflow/worker:0.1.0" in container["args"]
    assert pod["serviceAccountName"] == "kvflow-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_watched_namespaces_get_roles_and_the_cluster_role_only_what_is_cluster_wide(
    cluster: ControlPlane,
) -> None:
    docs = render(cluster, "--set", "operator.watchNamespaces={team-a,team-b}")
    (cluster_role,) = by_kind(docs, "ClusterRole")
    assert cluster_role["rules"] == CLUSTER_RULES  # reading CRDs, nothing namespaced
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in by_kind(docs, "Role")}
    assert sorted(roles) == [
        ("kvflow-system", "kvflow-operator-leader"),
        ("team-a", "kvflow-operator"),
        ("team-b", "kvflow-operator"),
    ]
    for namespace in ("team-a", "team-b"):
        assert roles[(namespace, "kvflow-operator")]["rules"] == NAMESPACED_RULES
    bindings = {
        (b["metadata"]["namespace"], b["metadata"]["name"]): b for b in by_kind(docs, "RoleBinding")
    }
    for namespace in ("team-a", "team-b"):
        binding = bindings[(namespace, "kvflow-operator")]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "kvflow-operator",
        }  # fmt: skip
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "kvflow-operator", "namespace": SYSTEM_NAMESPACE}
        ]
    # Cluster-wide (the default): one ClusterRole with everything, no namespaced Roles.
    docs = render(cluster)
    assert by_kind(docs, "ClusterRole")[0]["rules"] == NAMESPACED_RULES + CLUSTER_RULES
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == ["kvflow-operator-leader"]
    # The operator may create Secrets (a pool's worker token), never read one.
    secrets = [r for r in NAMESPACED_RULES if "secrets" in r["resources"]]
    assert secrets == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]


def test_admin_settings_become_operator_flags(cluster: ControlPlane) -> None:
    docs = render(
        cluster,
        "--set", "operator.allowedHostPathPrefixes={/models,/data/llm}",
        "--set", "operator.allowedPrometheusUrls={http://prometheus-operated.monitoring:9090}",
        "--set", "operator.metricsScraperNamespaces={monitoring,*}",
    )  # fmt: skip
    (deployment,) = by_kind(docs, "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-scraper-namespace=monitoring" in args
    assert "--metrics-scraper-namespace=*" in args
    assert "--allowed-host-path-prefix=/models" in args
    assert "--allowed-host-path-prefix=/data/llm" in args
    assert "--allowed-prometheus-url=http://prometheus-operated.monitoring:9090" in args
    # None by default: no hostPath volume, no Prometheus, no scraper beyond the operator.
    (deployment,) = by_kind(render(cluster), "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--allowed-", "--metrics-scraper"))]
    for bad in (
        ["--set", "operator.metricsScraperNamespaces={Monitoring}"],
        ["--set", "operator.allowedHostPathPrefixes={models}"],
        ["--set", "operator.allowedPrometheusUrls={http://user@prom:9090}"],
    ):
        out = cluster.helm("template", RELEASE, str(CHART), *bad, check=False)
        assert out.returncode != 0, bad


def test_redis_admits_only_kvflow_routers(cluster: ControlPlane) -> None:
    for watched, selector in (
        ([], {}),
        (
            ["--set", "operator.watchNamespaces={team-a}"],
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}
                ]
            },
        ),
    ):
        docs = render(cluster, "--set", "redis.enabled=true", *watched)
        (policy,) = by_kind(docs, "NetworkPolicy")
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == (
            "kvflow-redis"
        )
        assert policy["spec"]["ingress"] == [
            {
                "from": [
                    {
                        "podSelector": {
                            "matchLabels": {
                                "app.kubernetes.io/component": "router",
                                "app.kubernetes.io/managed-by": "kvflow-operator",
                            }
                        },
                        "namespaceSelector": selector,
                    }
                ],
                "ports": [{"protocol": "TCP", "port": 6379}],
            }
        ]


def test_example_pool_and_gateway_get_tenants(cluster: ControlPlane) -> None:
    docs = render(
        cluster, "--set", "examplePool.enabled=true", "--set", "exampleGateway.enabled=true"
    )
    (pool,) = by_kind(docs, "InferencePool")
    (gateway,) = by_kind(docs, "InferenceGateway")
    ref = {"name": "kvflow-example-tenants", "key": "tenants.yaml"}
    assert pool["spec"]["router"]["tenantsSecret"] == ref
    assert gateway["spec"]["router"]["tenantsSecret"] == ref
    (secret,) = by_kind(docs, "Secret")
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    tenants = yaml.safe_load(base64.b64decode(secret["data"]["tenants.yaml"]))
    assert tenants == {
        "tenants": [
            {"name": "example", "api_key_sha256": [hashlib.sha256(key.encode()).hexdigest()]}
        ]
    }
    assert len(key) > 40
    # A Secret of the user's own: the chart makes none.
    mine = "examplePool.spec.router.tenantsSecret"
    docs = render(
        cluster, "--set", "examplePool.enabled=true", "--set", f"{mine}.name=mine",
        "--set", f"{mine}.key=t",
    )  # fmt: skip
    assert by_kind(docs, "Secret") == []
    assert by_kind(docs, "InferencePool")[0]["spec"]["router"]["tenantsSecret"] == {
        "name": "mine", "key": "t",
    }  # fmt: skip


def test_template_with_redis_and_example_pool(cluster: ControlPlane) -> None:
    docs = render(
        cluster, "--set", "redis.enabled=true", "--set", "examplePool.enabled=true",
        "--set", "operator.watchNamespaces={team-a,team-b}",
    )  # fmt: skip
    (pool,) = by_kind(docs, "InferencePool")
    assert pool["metadata"]["namespace"] == SYSTEM_NAMESPACE
    # The pool reads the URL, password included, from the chart's Secret.
    assert pool["spec"]["router"]["redis"] == {"urlSecret": {"name": "kvflow-redis", "key": "url"}}
    # A pool that names its own Redis (a managed one) keeps it.
    managed = render(
        cluster, "--set", "redis.enabled=true", "--set", "examplePool.enabled=true",
        "--set", "examplePool.spec.router.redis.urlSecret.name=managed",
        "--set", "examplePool.spec.router.redis.urlSecret.key=u",
    )  # fmt: skip
    assert by_kind(managed, "InferencePool")[0]["spec"]["router"]["redis"] == {
        "urlSecret": {"name": "managed", "key": "u"}
    }
    (secret,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"] == "kvflow-redis"]
    password = base64.b64decode(secret["data"]["password"]).decode()
    assert len(password) == 32 and password.isalnum()
    assert base64.b64decode(secret["data"]["url"]).decode() == (
        f"redis://:{password}@kvflow-redis.{SYSTEM_NAMESPACE}.svc:6379/0"
    )
    redis = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "kvflow-redis")
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert container["args"][-2:] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert container["env"] == [
        {
            "name": "REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "kvflow-redis", "key": "password"}},
        }
    ]
    names = {d["metadata"]["name"] for d in by_kind(docs, "Deployment")}
    assert names == {"kvflow-operator", "kvflow-redis"}
    operator = next(
        d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "kvflow-operator"
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_values_schema_rejects_bad_values(cluster: ControlPlane) -> None:
    for bad, message in [
        (["--set", "operator.replicas=-1"], "minimum"),
        (["--set", "operator.logLevel=LOUD"], "operator/logLevel"),
        (["--set", "unknownKey=1"], "unknownKey"),
        (["--set", "examplePool.name=9lives"], "examplePool/name"),
        (["--set", "exampleGateway.name=smollm2-gateway"], "exampleGateway/name"),
    ]:
        out = cluster.helm("template", RELEASE, str(CHART), *bad, check=False)
        assert out.returncode != 0, bad
        assert message in out.stderr, (bad, out.stderr)


def test_helm_install_into_the_api_server(cluster: ControlPlane, chart_release: str) -> None:
    status = cluster.helm("status", chart_release, "-n", SYSTEM_NAMESPACE).stdout
    assert "STATUS: deployed" in status
    deployment = cluster.kubectl_json(
        "get", "deployment", "kvflow-operator", "-n", SYSTEM_NAMESPACE
    )
    # KWOK turned the operator's pods Ready; `helm install --wait` waited for them.
    assert deployment["status"]["readyReplicas"] == 2
    cluster.kubectl("get", "clusterrole", "kvflow-operator")
    cluster.kubectl("get", "role", "kvflow-operator-leader", "-n", SYSTEM_NAMESPACE)
    can = cluster.kubectl(
        "auth", "can-i", "patch", "deployments",
        "--as", f"system:serviceaccount:{SYSTEM_NAMESPACE}:kvflow-operator", "-A",
    )  # fmt: skip
    assert can.stdout.strip() == "yes"
    cannot = cluster.kubectl(
        "auth", "can-i", "get", "secrets",
        "--as", f"system:serviceaccount:{SYSTEM_NAMESPACE}:kvflow-operator", "-A", check=False,
    )  # fmt: skip
    assert cannot.stdout.strip() == "no"


def test_rendered_manifests_for_kubectl_users_are_current(cluster: ControlPlane) -> None:
    """deploy/kvflow-operator.yaml is `helm template` of the chart, for `kubectl apply`."""
    out = cluster.helm(
        "template", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE,
    )  # fmt: skip
    committed = (REPO / "deploy" / "kvflow-operator.yaml").read_text()
    assert committed == out.stdout, "stale: run `make manifests`"


def test_run_as_user_null_leaves_every_pods_user_to_the_platform(cluster: ControlPlane) -> None:
    """OpenShift's restricted SCC refuses pods naming a user outside the namespace's range:
    with runAsUser null no pod the chart or the operator makes names one."""

    def pods(*values: str) -> list[tuple[dict[str, Any], list[str]]]:
        docs = render(cluster, "--set", "redis.enabled=true", *values)
        return [(d["spec"]["template"]["spec"]["securityContext"],
                 d["spec"]["template"]["spec"]["containers"][0].get("args", []))
                for d in by_kind(docs, "Deployment")]  # fmt: skip

    default = pods()
    assert len(default) == 2  # the operator and Redis
    assert sorted(context["runAsUser"] for context, _ in default) == [999, 10001]
    assert any("--run-as-user=10001" in args for _, args in default)
    for context, args in pods("--set", "runAsUser=null"):
        assert context["runAsNonRoot"] is True
        assert not {"runAsUser", "runAsGroup", "fsGroup"} & set(context), context
        assert not [a for a in args if a.startswith("--run-as-user=") and a != "--run-as-user=none"]
    assert any("--run-as-user=none" in args for _, args in pods("--set", "runAsUser=null"))
    out = cluster.helm("template", RELEASE, str(CHART), "--set", "runAsUser=0", check=False)
    assert out.returncode != 0  # never root
