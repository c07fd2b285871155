"""The router's limits, circuit breaker and Batch API, and embedding pools, as the CRDs
say them: what the operator renders is what `kvflow router` and `kvflow worker` parse, each
CRD field changes the setting it names, and the CRD's defaults are the programs' own.

The operator never imports the router or the worker; this test imports all three and feeds
the rendered command lines and config files to the programs' own parsers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from fractions import Fraction
from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.settings import parse_args as parse_worker_args
from kvflow.operator.api import v1alpha1, v1alpha1_batch, v1alpha1_breaker
from kvflow.operator.api import v1alpha1_embedding as embedding_api
from kvflow.operator.api import v1alpha1_rate_limits as limits_api
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.desired import desired_children
from kvflow.operator.builders.names import Images, PoolRef
from kvflow.operator.builders.router import CONFIG_KEY, router_config
from kvflow.operator.builders.router_features import BATCH_MOUNT
from kvflow.router.batch.config import BatchConfig
from kvflow.router.breaker.machine import BreakerConfig
from kvflow.router.cli import parse_args as parse_router_args
from kvflow.router.limits.levels import DEFAULT_LEASE_TTL_S, LevelLimits
from kvflow.router.settings import RouterSettings

POOL = PoolRef(name="p", namespace="ns", uid="uid-1", generation=1)
IMAGES = Images(worker="w:1", router="r:1")
REDIS = {"url": "redis://redis:6379/0"}
# Flags only these features render: a pool that sets none of them gets none.
NEW_FLAGS = ("--global-", "--client-ip-", "--trusted-proxy-cidrs", "--limit-lease-ttl-s",
             "--breaker", "--batch-", "--task", "--max-embedding-")  # fmt: skip


def pool(**spec: Any) -> v1alpha1.InferencePoolSpec:
    return from_json(v1alpha1.InferencePoolSpec, {"model": {"servedName": "m"}, **spec})


def container(spec: v1alpha1.InferencePoolSpec, command: str) -> dict[str, Any]:
    for obj in desired_children(POOL, spec, IMAGES):
        if obj["kind"] == "Deployment":
            (c,) = obj["spec"]["template"]["spec"]["containers"]
            if c["args"][0] == command:
                return dict(c)
    raise AssertionError(f"no {command} container")


def router_settings(spec: v1alpha1.InferencePoolSpec, tmp_path: Path) -> RouterSettings:
    """The router's settings from the operator's args and config file, parsed by the
    router's own parser."""
    config = tmp_path / CONFIG_KEY
    config.write_text(yaml.safe_dump(router_config(spec)))
    args = [str(config) if a.endswith("/" + CONFIG_KEY) else a
            for a in container(spec, "router")["args"][1:]]  # fmt: skip
    settings = parse_router_args(args, env={})
    assert settings is not None
    return settings


def test_the_crds_defaults_are_the_programs_defaults() -> None:
    router = BreakerConfig()
    assert (router.failure_rate, router.window_s, router.min_requests, router.open_s,
          router.max_open_s, router.half_open_probes) == (
        v1alpha1_breaker.ROUTER_ERROR_RATE, v1alpha1_breaker.ROUTER_WINDOW_S,
        v1alpha1_breaker.ROUTER_MIN_REQUESTS, v1alpha1_breaker.ROUTER_OPEN_S,
        v1alpha1_breaker.ROUTER_MAX_OPEN_S, v1alpha1_breaker.ROUTER_HALF_OPEN_PROBES,
    )  # fmt: skip
    batch = BatchConfig()
    assert (
        v1alpha1_batch.ROUTER_MAX_FILE_BYTES, v1alpha1_batch.ROUTER_MAX_LINES,
        v1alpha1_batch.ROUTER_MAX_IN_FLIGHT, v1alpha1_batch.ROUTER_COMPLETION_WINDOW_S,
        Fraction(v1alpha1_batch.ROUTER_PRICE_FACTOR),
    ) == (batch.max_file_bytes, batch.max_lines, batch.max_in_flight,
          batch.completion_window_s, batch.price_factor)  # fmt: skip
    assert batch.tpot_headroom_fraction == v1alpha1_batch.ROUTER_TPOT_HEADROOM_FRACTION
    assert limits_api.ROUTER_LEASE_TTL_S == DEFAULT_LEASE_TTL_S
    worker = WorkerSettings()
    ours = (embedding_api.WORKER_MAX_INPUTS, embedding_api.WORKER_MAX_INPUT_TOKENS)
    assert ours == (worker.max_embedding_inputs, worker.max_embedding_input_tokens)


def test_a_pool_without_the_features_keeps_its_command_lines_and_the_routers_defaults(
    tmp_path: Path,
) -> None:
    spec = pool(router={"allowUnauthenticated": True})
    args = container(spec, "router")["args"] + container(spec, "worker")["args"]
    assert not [a for a in args if a.startswith(NEW_FLAGS)]
    assert "rate_limits" not in router_config(spec)
    settings = router_settings(spec, tmp_path)
    assert settings.breaker == BreakerConfig()
    assert settings.batch == BatchConfig()
    assert not settings.config.rate_limits.is_limited
    assert settings.config.rate_limits.trusted_proxies == ()


def _limits(**kinds: int) -> LevelLimits:
    return LevelLimits(**kinds)  # type: ignore[arg-type]


# (CRD router fields, what the router's settings say, the value expected there)
ROUTER_CASES: list[tuple[str, dict[str, Any], Callable[[RouterSettings], object], object]] = [
    ("global", {"rateLimits": {"global": {"requestsPerMinute": 6000, "tokensPerMinute": 2000000,
                                          "maxInFlight": 512}}},
     lambda s: s.config.rate_limits.global_limits, _limits(requests_per_minute=6000,
                                                           tokens_per_minute=2000000,
                                                           max_in_flight=512)),
    ("client-ip", {"rateLimits": {"clientIp": {"requestsPerMinute": 120, "maxInFlight": 8}}},
     lambda s: s.config.rate_limits.client_ip, _limits(requests_per_minute=120, max_in_flight=8)),
    ("per-model", {"rateLimits": {"models": [{"name": "m", "tokensPerMinute": 500000},
                                             {"name": "other", "maxInFlight": 3}]}},
     lambda s: dict(s.config.rate_limits.models),
     {"m": _limits(tokens_per_minute=500000), "other": _limits(max_in_flight=3)}),
    ("trusted-proxies", {"rateLimits": {"trustedProxyCidrs": ["10.0.0.0/8", "fd00::/8"]}},
     lambda s: s.config.rate_limits.trusted_proxies,
     (ip_network("10.0.0.0/8"), ip_network("fd00::/8"))),
    ("lease", {"redis": REDIS, "rateLimits": {"leaseTtlSeconds": 15}},
     lambda s: s.config.rate_limits.lease_ttl_s, 15.0),
    ("breaker-off", {"circuitBreaker": {"enabled": False}}, lambda s: s.breaker.is_enabled, False),
    ("breaker-rate", {"circuitBreaker": {"errorRateThreshold": 0.25}},
     lambda s: s.breaker.failure_rate, 0.25),
    ("breaker-window", {"circuitBreaker": {"windowSeconds": 12.5}},
     lambda s: s.breaker.window_s, 12.5),
    ("breaker-min", {"circuitBreaker": {"minRequests": 40}}, lambda s: s.breaker.min_requests, 40),
    ("breaker-open", {"circuitBreaker": {"openSeconds": 3}}, lambda s: s.breaker.open_s, 3.0),
    ("breaker-max-open", {"circuitBreaker": {"maxOpenSeconds": 60}},
     lambda s: s.breaker.max_open_s, 60.0),
    ("breaker-probes", {"circuitBreaker": {"halfOpenProbes": 5}},
     lambda s: s.breaker.half_open_probes, 5),
    ("batch-volume", {"batch": {"storage": "Volume",
                                "persistentVolumeClaim": {"claimName": "batches"}}},
     lambda s: s.batch.batch_dir, Path(BATCH_MOUNT)),
    ("batch-redis", {"redis": REDIS, "batch": {"storage": "Redis"}},
     lambda s: (s.redis_url, s.batch.batch_dir), (REDIS["url"], None)),
    ("batch-file", {"batch": {"maxFileBytes": 1048576}}, lambda s: s.batch.max_file_bytes, 1048576),
    ("batch-lines", {"batch": {"maxLines": 100}}, lambda s: s.batch.max_lines, 100),
    ("batch-in-flight", {"batch": {"maxInFlight": 16}}, lambda s: s.batch.max_in_flight, 16),
    ("batch-window", {"batch": {"completionWindowSeconds": 3600}},
     lambda s: s.batch.completion_window_s, 3600.0),
    ("batch-price", {"batch": {"priceFactor": "0.25"}},
     lambda s: s.batch.price_factor, Fraction(1, 4)),
    # Where the Batch API is on, batch requests are paced by the pool's TPOT target (100 ms
    # by default), or by the batch's own.
    ("batch-paced-by-slo", {"redis": REDIS},
     lambda s: (s.batch.online_tpot_target_s, s.batch.tpot_headroom_fraction), (0.1, 0.3)),
    ("batch-paced-own", {"redis": REDIS, "batch": {"onlineTpotTargetMs": 40,
                                                   "tpotHeadroomFraction": 0.5}},
     lambda s: (s.batch.online_tpot_target_s, s.batch.tpot_headroom_fraction), (0.04, 0.5)),
]  # fmt: skip


@pytest.mark.parametrize(("router", "read", "expected"), [c[1:] for c in ROUTER_CASES],
                         ids=[c[0] for c in ROUTER_CASES])  # fmt: skip
def test_each_field_reaches_the_routers_parsed_settings(
    router: dict[str, Any],
    read: Callable[[RouterSettings], object],
    expected: object,
    tmp_path: Path,
) -> None:
    default = read(router_settings(pool(router={"allowUnauthenticated": True}), tmp_path))
    got = read(router_settings(pool(router={"allowUnauthenticated": True, **router}), tmp_path))
    assert got == expected
    assert got != default


def test_batch_volume_is_mounted_read_write_where_the_router_writes() -> None:
    spec = pool(router={"allowUnauthenticated": True,
                        "batch": {"storage": "Volume",
                                  "persistentVolumeClaim": {"claimName": "batches"}}})  # fmt: skip
    router = container(spec, "router")
    (mount,) = [m for m in router["volumeMounts"] if m["mountPath"] == BATCH_MOUNT]
    assert not mount.get("readOnly")
    children = desired_children(POOL, spec, IMAGES)
    (deployment,) = [o for o in children if o["metadata"]["name"] == "p-router"
                     and o["kind"] == "Deployment"]  # fmt: skip
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": mount["name"], "persistentVolumeClaim": {"claimName": "batches"}} in volumes


def test_an_embedding_pool_runs_the_workers_embed_task() -> None:
    spec = pool(task="embed", colocated={"replicas": 2},
                embedding={"maxInputsPerRequest": 64, "maxInputTokens": 512})  # fmt: skip
    worker = container(spec, "worker")
    settings = parse_worker_args(worker["args"][1:])
    assert settings.task == "embed"
    assert settings.model is None  # the image's built-in wordllama-l2-supercat
    assert settings.served_model_name == "m"
    assert (settings.max_embedding_inputs, settings.max_embedding_input_tokens) == (64, 512)
    assert settings.device == "cpu"
    # A generating pool's worker is unchanged by the embedding limits.
    generating = parse_worker_args(container(pool(), "worker")["args"][1:])
    assert generating.task == "generate"


def test_an_embedding_pool_with_worker_tls_and_a_gpu_parses(tmp_path: Path) -> None:
    spec = pool(task="embed", colocated={"gpusPerPod": 1}, workerTls={"secretName": "tls"})
    args = container(spec, "worker")["args"][1:]
    # The worker checks its TLS files exist: stand in for the mounted Secret.
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).write_text("pem")
    args = [str(tmp_path / Path(a).name) if a.startswith("/etc/") else a for a in args]
    settings = parse_worker_args(args)
    assert settings.task == "embed" and settings.device == "cuda" and settings.tls.is_on


def test_the_crd_rules_name_what_an_embedding_worker_cannot_run() -> None:
    """The pool-level CEL rules (checked for real on the API server in
    tests/k8s/test_router_features.py) exist for each thing the worker refuses."""
    rules = {r.field_path for r in embedding_api.EMBED_RULES}
    assert rules == {".model", ".mode", ".engine.simulate", ".colocated.gpusPerPod",
                     ".autoscaling.enabled"}  # fmt: skip
    names = {f.name for f in fields(v1alpha1.InferencePoolSpec)}
    assert {"task", "embedding"} <= names


def test_extra_args_may_not_set_the_task_or_embedding_limits() -> None:
    from kvflow.operator.api.validation import spec_problems

    spec = pool(
        task="embed", engine={"extraArgs": ["--task=generate", "--max-embedding-inputs", "9"]}
    )
    (problem,) = spec_problems(spec)
    assert "--max-embedding-inputs, --task" in problem


def test_an_embedding_pool_is_not_judged_by_a_kv_cache_it_does_not_have() -> None:
    from kvflow.operator.api.validation import spec_problems

    small = {"replicas": 1, "resources": {"limits": {"memory": "512Mi"}}}
    assert spec_problems(pool(task="embed", colocated=small)) == []
    assert spec_problems(pool(colocated=small))  # a generating worker's 1 GiB cache: too big


def test_a_pools_batch_requests_are_paced_by_its_own_tpot_target(tmp_path: Path) -> None:
    spec = pool(router={"redis": REDIS}, slo={"tpotTargetMs": 35})
    assert router_settings(spec, tmp_path).batch.online_tpot_target_s == 0.035
    # No Batch API (no Redis, no volume): no pacing flag, the command line as before.
    assert "--batch-online-tpot-target-s" not in container(pool(), "router")["args"]
