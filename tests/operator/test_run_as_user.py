"""The user kvflow's pods name: the images' 10001 by default; none at all with
`--run-as-user none`, so that a platform assigning users (OpenShift's restricted SCC,
which refuses a pod naming a user outside the namespace's range) can run them. Pure
builders and the operator's flag; tests/k8s/test_chart.py renders the chart's side."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from testkit.pool_spec import POOL, spec_of

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import desired_children
from kvflow.operator.builders.gateway import GatewayRef, desired_gateway_children
from kvflow.operator.builders.gateway_models import ModelObject, resolve
from kvflow.operator.builders.names import IMAGE_UID, Images
from kvflow.operator.cli import parse_args, run_as_user

IDS = ("runAsUser", "runAsGroup", "fsGroup")


def pod_contexts(images: Images) -> list[dict[str, Any]]:
    children = desired_children(POOL, spec_of(mode="disaggregated", prefill={}, decode={}),
                                images)  # fmt: skip
    return [c["spec"]["template"]["spec"]["securityContext"]
            for c in children if c["kind"] == "Deployment"]  # fmt: skip


def test_pods_run_as_the_images_user_by_default() -> None:
    contexts = pod_contexts(Images(worker="w:1", router="r:1"))
    assert len(contexts) == 3  # prefill, decode, router
    for context in contexts:
        assert context["runAsNonRoot"] is True
        assert [context[k] for k in IDS] == [IMAGE_UID] * 3


def test_with_none_the_pods_name_no_user_and_stay_non_root() -> None:
    for context in pod_contexts(Images(worker="w:1", router="r:1", run_as_uid=None)):
        assert context == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def test_a_gateways_routers_follow_the_same_setting() -> None:
    gateway = GatewayRef(name="front", namespace="ns", uid="uid-g")
    spec = from_json(gw.InferenceGatewaySpec, {"router": {}})
    pools = {"p": from_json(v1alpha1.InferencePoolSpec, {"model": {"servedName": "m"}})}
    target = {"gatewayRef": {"name": "front"}, "targets": [{"poolRef": {"name": "p"}}]}
    resolution = resolve([ModelObject("m", from_json(gw.InferenceModelSpec, target))], pools)
    for uid in (IMAGE_UID, None, 4242):
        images = Images(worker="w:1", router="r:1", run_as_uid=uid)
        children = desired_gateway_children(gateway, spec, images, resolution, pools)
        (deployment,) = [c for c in children if c["kind"] == "Deployment"]
        context = deployment["spec"]["template"]["spec"]["securityContext"]
        assert context.get("runAsUser") == uid and context["runAsNonRoot"] is True


def test_the_flag_takes_a_non_root_user_id_or_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args([]).run_as_user == IMAGE_UID
    assert parse_args(["--run-as-user", "none"]).run_as_user is None
    assert parse_args(["--run-as-user", "1000680000"]).run_as_user == 1000680000
    for bad in ("0", "-1", "root"):
        with pytest.raises(argparse.ArgumentTypeError):
            run_as_user(bad)
        with pytest.raises(SystemExit):
            parse_args(["--run-as-user", bad])
    assert "non-root user id" in capsys.readouterr().err
