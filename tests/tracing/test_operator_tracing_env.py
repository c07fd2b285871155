"""The pool's spec.observability reaches the router and worker containers as OTel's
standard variables, which the router and workers read back into the same settings."""

from __future__ import annotations

from typing import Any

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import desired_children
from kvflow.operator.builders.names import Images, PoolRef
from kvflow.proto.otel import tracing_config

POOL = PoolRef(name="p", namespace="ns", uid="uid-1", generation=3)
IMAGES = Images(worker="img/worker:1", router="img/router:1")
ENDPOINT = "http://otel-collector.observability:4317"


def container_envs(spec_json: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each Deployment's first container's literal env values, by Deployment name."""
    spec = from_json(v1alpha1.InferencePoolSpec, {"model": {"servedName": "m"}, **spec_json})
    envs = {}
    for child in desired_children(POOL, spec, IMAGES):
        if child["kind"] == "Deployment" and child["metadata"]["name"] != "p-redis":
            container = child["spec"]["template"]["spec"]["containers"][0]
            envs[child["metadata"]["name"]] = {
                e["name"]: e["value"] for e in container.get("env", []) if "value" in e
            }
    return envs


def test_an_endpoint_reaches_every_router_and_worker_container() -> None:
    envs = container_envs({
        "mode": "disaggregated", "prefill": {}, "decode": {},
        "observability": {"otlpTracesEndpoint": ENDPOINT, "tracesSampleRatio": 0.25},
    })  # fmt: skip
    assert len(envs) == 3, envs.keys()  # router, prefill and decode
    for name, env in envs.items():
        assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == ENDPOINT, name
        assert "kvflow.pool=p" in env["OTEL_RESOURCE_ATTRIBUTES"]
        # What the router and the workers read back (both read through kvflow.proto.otel).
        config = tracing_config(None, None, env)
        assert (config.endpoint, config.sample_ratio) == (ENDPOINT, 0.25), name


def test_no_endpoint_no_variables() -> None:
    for name, env in container_envs({}).items():
        assert not [k for k in env if k.startswith("OTEL_")], name
        assert tracing_config(None, None, env).endpoint is None
