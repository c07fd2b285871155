"""An embedding pool as the operator renders it serves: the real `kvflow worker` started
with the worker Deployment's args, the real `kvflow router` with the router Deployment's
args and config (only the addresses swapped for this machine's), and a client's
/v1/embeddings answered, with the pool's global limit enforced by the router."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testkit.gateway_process import launch_gateway
from testkit.worker_process import launch_worker

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import desired_children
from kvflow.operator.builders.names import Images, PoolRef
from kvflow.operator.builders.router import CONFIG_KEY, router_config

pytestmark = [pytest.mark.integration]

POOL = PoolRef(name="emb", namespace="ns", uid="uid-1", generation=1)
SPEC = from_json(v1alpha1.InferencePoolSpec, {
    "model": {"servedName": "wordllama"},
    "task": "embed",
    "embedding": {"maxInputsPerRequest": 4},
    "router": {"allowUnauthenticated": True,
               "rateLimits": {"global": {"requestsPerMinute": 2}},
               "circuitBreaker": {"minRequests": 5}},
})  # fmt: skip
# What Kubernetes gives a pod and this machine does not: fixed ports and a headless Service.
ADDRESS_FLAGS = ("--host", "--port", "--metrics-port", "--worker-dns")


def args_of(command: str) -> list[str]:
    for obj in desired_children(POOL, SPEC, Images(worker="w", router="r")):
        if obj["kind"] == "Deployment":
            (c,) = obj["spec"]["template"]["spec"]["containers"]
            if c["args"][0] == command:
                return list(c["args"][1:])
    raise AssertionError(command)


def without(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


def test_the_rendered_embedding_pool_answers_embeddings(tmp_path: Path) -> None:
    worker = launch_worker(without(args_of("worker"), ADDRESS_FLAGS))
    try:
        config = tmp_path / CONFIG_KEY
        config.write_text(yaml.safe_dump(router_config(SPEC)))
        router_args = [str(config) if a.endswith("/" + CONFIG_KEY) else a
                       for a in without(args_of("router"), ADDRESS_FLAGS)]  # fmt: skip
        gateway = launch_gateway([*router_args, "--workers", worker.address])
        try:
            gateway.wait_ready(num_workers=1)
            body: dict[str, Any] = {"model": "wordllama", "input": ["a text", "another"]}
            url = f"{gateway.base_url}/embeddings"
            # The pool's embedding.maxInputsPerRequest reached the worker (a request it
            # refuses costs no limit: the router admits after the worker counted tokens).
            many = httpx.post(url, json={**body, "input": ["x"] * 5}, timeout=30)
            assert many.status_code == 400, many.text
            for _ in range(2):
                ok = httpx.post(url, json=body, timeout=30)
                assert ok.status_code == 200, ok.text
                assert [d["index"] for d in ok.json()["data"]] == [0, 1]
            # Two requests a minute at most (router.rateLimits.global): the third is refused.
            third = httpx.post(url, json=body, timeout=30)
            assert third.status_code == 429, third.text
            assert "retry-after" in third.headers
        finally:
            gateway.stop()
    finally:
        worker.stop(timeout_s=10)
