"""What the operator writes into pods is what the worker and router actually accept.

The operator builds command lines and a config file for programs it never imports; these
tests feed its output to the real parsers of `kvflow worker` and `kvflow router`, so a
renamed flag or config key fails here instead of in a crash-looping pod.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow.engine_worker.settings import parse_args as parse_worker_args
from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import from_json
from kvflow.operator.api.v1alpha1_admission import (
    ROUTER_MAX_QUEUE_TIME_S,
    ROUTER_SHED_QUEUE_TIME_S,
)
from kvflow.operator.builders.desired import desired_children
from kvflow.operator.builders.names import Images, PoolRef
from kvflow.operator.builders.router import CONFIG_KEY, router_config
from kvflow.proto.roles import Role
from kvflow.router.cli import parse_args as parse_router_args
from kvflow.router.serving.admission import (
    DEFAULT_MAX_QUEUE_TIME_S,
    DEFAULT_SHED_QUEUE_TIME_S,
    AdmissionConfig,
)
from kvflow.router.settings import RouterSettings, parse_config

POOL = PoolRef(name="p", namespace="ns", uid="uid-1", generation=1)
IMAGES = Images(worker="w:1", router="r:1")
SAMPLES = Path(__file__).resolve().parents[2] / "samples"


def spec_of(data: dict[str, Any]) -> v1alpha1.InferencePoolSpec:
    return from_json(v1alpha1.InferencePoolSpec, data)


def sample_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for path in sorted(SAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferencePool":
                specs.append((path.name, doc["spec"]))
    return specs


SPECS = [
    ("minimal", {"model": {"servedName": "m"}}),
    ("tensor-parallel", {"model": {"servedName": "m"}, "colocated": {"gpusPerPod": 3}}),
    (
        "weights",
        {
            "model": {"servedName": "m", "dtype": "bfloat16"},
            "router": {
                "scorerWeights": {"prefixCache": 2.0, "queueDepth": 0.5, "kvCacheUsage": 3.0}
            },
        },
    ),
    *sample_specs(),
]


def containers(spec: v1alpha1.InferencePoolSpec) -> list[dict[str, Any]]:
    out = []
    for obj in desired_children(POOL, spec, IMAGES):
        if obj["kind"] == "Deployment":
            out += obj["spec"]["template"]["spec"]["containers"]
    return out


@pytest.mark.parametrize(("name", "data"), SPECS, ids=[n for n, _ in SPECS])
def test_worker_and_router_accept_the_operators_command_lines(
    name: str, data: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = spec_of(data)
    seen = set()
    for container in containers(spec):
        args = list(container["args"])
        command, rest = args[0], args[1:]
        if command == "worker":
            # Kubernetes expands $(POD_IP) from the downward API before the worker sees it.
            rest = [a.replace("$(POD_IP)", "10.0.0.7") for a in rest]
            settings = parse_worker_args(rest)
            assert (
                settings.host == "0.0.0.0" and settings.served_model_name == spec.model.served_name
            )
            assert settings.block_size == spec.engine.block_size
            assert settings.drain_timeout_s == spec.engine.drain_timeout_seconds
            if spec.mode == "disaggregated":
                assert settings.role in ("prefill", "decode")
                assert settings.kv_transport == spec.kv_transport
                assert settings.kv_port == 50052
                assert settings.advertise_host == "10.0.0.7"
            else:
                assert settings.role is Role.COLOCATED
            seen.add("worker")
        elif command == "router":
            config = tmp_path / CONFIG_KEY
            config.write_text(yaml.safe_dump(router_config(spec)))
            rest = [str(config) if a.endswith("/" + CONFIG_KEY) else a for a in rest]
            rest = [a if not a.startswith("$(") else "redis://127.0.0.1:6379" for a in rest]
            settings = parse_router_args(rest)
            assert settings is not None and settings.worker_dns
            seen.add("router")
        else:
            raise AssertionError(f"unknown kvflow command {command!r} in {name}")
    assert seen == {"worker", "router"}


def test_router_config_weights_reach_the_router() -> None:
    spec = spec_of(
        {
            "model": {"servedName": "m"},
            "router": {
                "scorerWeights": {"prefixCache": 2.0, "queueDepth": 0.5, "kvCacheUsage": 3.0}
            },
        }
    )
    config = parse_config(yaml.safe_load(yaml.safe_dump(router_config(spec))))
    assert config.weights["prefix_cache"] == 2.0
    assert config.weights["queue_depth"] == 0.5
    assert config.weights["kv_cache_usage"] == 3.0


def test_unset_weights_leave_the_routers_time_based_default() -> None:
    from kvflow.router.routing.pipeline import BLOCK_WEIGHTS, DEFAULT_WEIGHTS

    config = parse_config(yaml.safe_load(yaml.safe_dump(router_config(spec_of({
        "model": {"servedName": "m"}})))))  # fmt: skip
    assert dict(config.weights) == dict(DEFAULT_WEIGHTS)
    # One block weight selects the block policy, the rest at its defaults.
    one = spec_of({"model": {"servedName": "m"}, "router": {"scorerWeights": {"kvCacheUsage": 1}}})
    config = parse_config(yaml.safe_load(yaml.safe_dump(router_config(one))))
    assert dict(config.weights) == {**BLOCK_WEIGHTS, "kv_cache_usage": 1.0}


def test_router_accepts_the_disaggregation_policy() -> None:
    spec = spec_of(
        {
            "model": {"servedName": "m"},
            "mode": "disaggregated",
            "prefill": {},
            "decode": {},
            "router": {
                "disaggregation": {
                    "minRemotePrefillTokens": 300,
                    "maxPrefillQueueDepth": 4,
                    "transferTimeoutSeconds": 2.5,
                }
            },
        }
    )
    policy = parse_config(yaml.safe_load(yaml.safe_dump(router_config(spec)))).disaggregation
    assert policy.enabled is True
    assert policy.min_remote_prefill_tokens == 300
    assert policy.max_prefill_queue_depth == 4
    assert policy.transfer_timeout_s == 2.5


def test_the_admission_spec_reaches_the_router_and_its_defaults_are_the_routers(
    tmp_path: Path,
) -> None:
    config = tmp_path / CONFIG_KEY
    config.write_text("{}")

    def router_settings(spec: v1alpha1.InferencePoolSpec) -> RouterSettings:
        (router,) = [c for c in containers(spec) if c["args"][0] == "router"]
        args = [str(config) if a.endswith("/" + CONFIG_KEY) else a for a in router["args"][1:]]
        settings = parse_router_args(args, env={})
        assert settings is not None
        return settings

    spec = spec_of({"model": {"servedName": "m"},
                    "router": {"admission": {"shedQueueTimeSeconds": 2.5,
                                             "maxQueueTimeSeconds": 5,
                                             "pollIntervalSeconds": 0.25}}})  # fmt: skip
    assert router_settings(spec).admission == AdmissionConfig(2.5, 5.0, 0.25, is_enabled=True)
    off = spec_of({"model": {"servedName": "m"}, "router": {"admission": {"enabled": False}}})
    assert not router_settings(off).admission.is_enabled
    # The CRD's CEL rule repeats the router's defaults (v1alpha1_admission).
    assert (ROUTER_SHED_QUEUE_TIME_S, ROUTER_MAX_QUEUE_TIME_S) == (
        DEFAULT_SHED_QUEUE_TIME_S, DEFAULT_MAX_QUEUE_TIME_S)  # fmt: skip
