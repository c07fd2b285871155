"""An InferencePool spec and the objects the operator's pure builders make of it, for the
builder tests (tests/operator/test_builders*.py)."""

from __future__ import annotations

from typing import Any

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import ChildKey, desired_children
from kvflow.operator.builders.names import Images, PoolRef

POOL = PoolRef(name="p", namespace="ns", uid="uid-1", generation=3)
IMAGES = Images(worker="img/worker:1", router="img/router:1")


def spec_of(**overrides: Any) -> v1alpha1.InferencePoolSpec:
    data: dict[str, Any] = {"model": {"servedName": "m"}}
    data.update(overrides)
    return from_json(v1alpha1.InferencePoolSpec, data)


def build(spec: v1alpha1.InferencePoolSpec) -> dict[ChildKey, dict[str, Any]]:
    return {ChildKey.of(o): o for o in desired_children(POOL, spec, IMAGES)}


def pod_of(children: dict[ChildKey, dict[str, Any]], name: str) -> dict[str, Any]:
    pod: dict[str, Any] = children[ChildKey("apps/v1", "Deployment", name)]["spec"]["template"][
        "spec"
    ]
    return pod
