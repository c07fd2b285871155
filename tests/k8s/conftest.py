"""Session fixtures: one real control plane, the CRD, the chart and the operator's identity.

The control plane starts once per session (about 20-40 s on two busy cores) and every
process it started is stopped after the last test of this folder, whatever happened: left
running (kube-controller-manager, KWOK's heartbeats, namespaces still being deleted) it took
CPU from the tests after it, and the CPU-clock calibration in tests/sim saw its fitted
steps 1.4-1.8x slower than the run it predicted.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from k8s.controlplane import (
    CHART,
    RELEASE,
    REPO,
    SYSTEM_NAMESPACE,
    Binaries,
    ControlPlane,
)
from k8s.operator_process import OperatorProcess
from k8s.support import wait_for, which_openssl, write_kubeconfig

HERE = Path(__file__).parent
_planes: list[ControlPlane] = []


def _in_here(item: pytest.Item) -> bool:
    return HERE in Path(str(item.fspath)).parents


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _in_here(item):
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the control plane once no test of this folder is left to run (the session
    fixture's own teardown would wait for the whole session's end); after the test's own
    fixtures are torn down, which still talk to it."""
    yield
    if not _planes or not _in_here(item):
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any(_in_here(x) for x in later):
        for plane in _planes:
            plane.down()


@pytest.fixture(scope="session")
def binaries() -> Binaries:
    which_openssl()
    return Binaries.locate()


@pytest.fixture(scope="session")
def cluster(binaries: Binaries, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(binaries, tmp_path_factory.mktemp("k8s"))
    try:
        plane.up()
    except BaseException:
        print(plane.logs(), file=sys.stderr)
        plane.down()
        raise
    _planes.append(plane)
    yield plane
    plane.down()


@pytest.fixture(scope="session")
def crd(cluster: ControlPlane) -> str:
    """The kvflow.io CRDs (InferencePool, InferenceGateway, InferenceModel), applied from
    crds/ with kubectl and Established; the InferencePool CRD's name."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))

    # Polled, not `kubectl wait --for=condition=Established`: that fails at once ("status
    # .conditions accessor error: <nil>") when it reads a CRD the API server has not given
    # conditions yet, which lost a clean CI run all 38 of its Kubernetes tests.
    def established(name: str) -> bool:
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        out = cluster.kubectl("get", f"crd/{name}", "-o", f"jsonpath={jsonpath}", check=False)
        return out.returncode == 0 and out.stdout.strip() == "True"

    for plural in ("inferencepools", "inferencegateways", "inferencemodels"):
        wait_for(partial(established, f"{plural}.kvflow.io"), 60, f"crd/{plural} Established")

    # The API server publishes a CRD's OpenAPI (what explain and server-side apply read)
    # a moment after Established.
    def explained(kind: str) -> bool:
        return cluster.kubectl("explain", kind, check=False).returncode == 0

    for kind in ("inferencepool", "inferencegateway", "inferencemodel"):
        wait_for(partial(explained, kind), 60, f"the {kind} OpenAPI schema to be published")
    return "inferencepools.kvflow.io"


@pytest.fixture(scope="session")
def chart_release(cluster: ControlPlane, crd: str) -> str:
    """The chart installed with the real helm (operator Deployment, RBAC, ServiceAccount)."""
    cluster.helm(
        "install", RELEASE, str(CHART),
        "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
        "--wait", "--timeout", "180s",
    )  # fmt: skip
    return RELEASE


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: ControlPlane, chart_release: str) -> Path:
    """Credentials of the chart's ServiceAccount: the operator under test holds exactly
    the chart's RBAC, so a missing permission fails these tests."""
    token = cluster.kubectl(
        "create", "token", "kvflow-operator", "-n", SYSTEM_NAMESPACE, "--duration", "6h"
    ).stdout.strip()
    return write_kubeconfig(
        cluster.workdir / "operator.kubeconfig",
        cluster.server,
        cluster.workdir / "pki" / "ca.crt",
        token,
        "kvflow-operator",
    )


@pytest.fixture()
def namespace(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test, deleted (with everything in it) afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:6]
    name = f"t-{slug[:40].strip('-')}-{digest}"
    cluster.kubectl("create", "namespace", name)
    wait_for(
        lambda: (
            cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode
            == 0
        ),
        60,
        f"namespace {name}'s default ServiceAccount",
    )
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture()
def operator(
    cluster: ControlPlane, operator_kubeconfig: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """A real `kvflow operator` process with the chart's RBAC; stopped after the test."""
    proc = OperatorProcess(cluster, operator_kubeconfig, tmp_path, identity="op-a")
    proc.start()
    yield proc
    proc.stop()
