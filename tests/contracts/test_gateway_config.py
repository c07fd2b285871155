"""An InferenceGateway's router.yaml and command line are what `kvflow router` accepts.

The operator renders the router's multi-pool config (pools: and models:) for programs it
never imports; the router's own parsers read it here, so a renamed key or a refused
combination fails in this test instead of in a crash-looping gateway.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from kvflow.operator.api import v1alpha1
from kvflow.operator.api import v1alpha1_gateway as gw
from kvflow.operator.api.schema import from_json
from kvflow.operator.builders.gateway import GatewayRef, desired_gateway_children
from kvflow.operator.builders.gateway_models import ModelObject, resolve
from kvflow.operator.builders.names import Images
from kvflow.operator.builders.router import CONFIG_KEY
from kvflow.router.cli import parse_args as parse_router_args
from kvflow.router.settings import parse_config

GATEWAY = GatewayRef(name="front", namespace="ns", uid="uid-g", generation=1)

POOLS = {
    "v1": from_json(
        v1alpha1.InferencePoolSpec,
        {
            "model": {
                "servedName": "smollm2-v1",
                "path": "v1/model.gguf",
                "volume": {"hostPath": {"path": "/data"}},
            }
        },
    ),
    "v2": from_json(
        v1alpha1.InferencePoolSpec,
        {
            "model": {"servedName": "smollm2-v2"},
            "mode": "disaggregated",
            "prefill": {},
            "decode": {},
            "router": {"disaggregation": {"maxPrefillQueueDepth": 3}},
        },
    ),
}


def model(name: str, targets: dict[str, int], **spec: Any) -> ModelObject:
    data = {
        "gatewayRef": {"name": "front"},
        "targets": [{"poolRef": {"name": p}, "weight": w} for p, w in targets.items()],
        **spec,
    }
    return ModelObject(name, from_json(gw.InferenceModelSpec, data))


def test_the_router_reads_the_gateways_pools_and_models(tmp_path: Path) -> None:
    resolution = resolve(
        [
            model("smollm2", {"v1": 95, "v2": 5}, aliases=["chat"]),
            model("pinned", {"v2": 1}, modelName="smollm2-latest"),
        ],
        POOLS,
    )
    spec = from_json(gw.InferenceGatewaySpec, {"router": {"redis": {"url": "redis://r:6379"}}})
    configmap, _, deployment, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, POOLS
    )
    config = parse_config(yaml.safe_load(configmap["data"][CONFIG_KEY]))
    pools = {p.name: p for p in config.pools}
    assert pools["v1"].served_model_name == "smollm2-v1"
    assert pools["v1"].model == "/models/v1/v1/model.gguf"
    assert pools["v1"].worker_dns == "v1-workers.ns.svc:50051"
    assert pools["v2"].disaggregation.enabled
    assert pools["v2"].disaggregation.max_prefill_queue_depth == 3
    served = {name: p.served_model_name or "" for name, p in pools.items()}
    assert config.models.resolve("chat", 0.0, served) == "v1"
    assert config.models.resolve("smollm2", 0.99, served) == "v2"
    assert config.models.resolve("smollm2-latest", 0.5, served) == "v2"

    # The command line carries no one-pool flag, which the router refuses beside pools:.
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "router"
    written = tmp_path / CONFIG_KEY
    written.write_text(configmap["data"][CONFIG_KEY])
    args = [str(written) if a.endswith(f"/{CONFIG_KEY}") else a for a in args[1:]]
    settings = parse_router_args(args, env={})
    assert settings is not None
    assert [p.name for p in settings.config.pools] == ["v1", "v2"]


def test_the_router_dials_each_tls_pool_with_the_files_the_gateway_mounts(tmp_path: Path) -> None:
    pools = {**POOLS, "v3": from_json(v1alpha1.InferencePoolSpec, {
        "model": {"servedName": "smollm2-v3"}, "workerTls": {"secretName": "v3-tls"}})}  # fmt: skip
    resolution = resolve([model("smollm2", {"v1": 1, "v3": 1})], pools)
    spec = from_json(gw.InferenceGatewaySpec, {"router": {"redis": {"url": "redis://r:6379"}}})
    configmap, _, deployment, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, pools
    )
    # The Secret's files where the pod mounts them, rooted in tmp_path here.
    pod = deployment["spec"]["template"]["spec"]
    (mount,) = [m["mountPath"] for m in pod["containers"][0]["volumeMounts"]
                if m["name"] == "tls-v3"]  # fmt: skip
    root = tmp_path / mount.lstrip("/")
    root.mkdir(parents=True)
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (root / name).write_text("-----BEGIN X-----\n")
    text = configmap["data"][CONFIG_KEY].replace(mount, str(root))
    config = parse_config(yaml.safe_load(text))
    by_name = {p.name: p for p in config.pools}
    tls = by_name["v3"].worker_tls
    assert tls is not None
    assert (tls.ca_file, tls.cert_file, tls.key_file) == (
        f"{root}/ca.crt", f"{root}/tls.crt", f"{root}/tls.key")  # fmt: skip
    assert tls.server_name == "v3-workers.ns.svc"
    assert by_name["v1"].worker_tls is None  # plaintext: the router has no --worker-tls-* flags


def test_the_router_charges_each_pools_prices_exactly() -> None:
    from kvflow.operator.builders.router import router_config
    from kvflow.router.tenants.money import ModelPrices

    prices = {"inputUsdPerMillionTokens": "0.15", "cachedInputUsdPerMillionTokens": "0.075",
              "outputUsdPerMillionTokens": "0.6"}  # fmt: skip
    priced = from_json(v1alpha1.InferencePoolSpec,
                       {"model": {"servedName": "smollm2-v3", "prices": prices}})  # fmt: skip
    expected = ModelPrices(150_000, 75_000, 600_000)  # pico-USD per token
    # A pool's own router ...
    config = parse_config(yaml.safe_load(yaml.safe_dump(router_config(priced))))
    assert config.prices == {"smollm2-v3": expected}
    assert parse_config(yaml.safe_load(yaml.safe_dump(router_config(POOLS["v1"])))).prices == {}
    # ... and a gateway's, under each pool's served name (an unpriced pool: free).
    pools = {**POOLS, "v3": priced}
    resolution = resolve([model("smollm2", {"v1": 1, "v3": 1})], pools)
    spec = from_json(gw.InferenceGatewaySpec, {"router": {"redis": {"url": "redis://r:6379"}}})
    configmap, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, pools
    )
    config = parse_config(yaml.safe_load(configmap["data"][CONFIG_KEY]))
    assert config.prices == {"smollm2-v3": expected}


def test_the_router_reads_each_models_degradation_ladder() -> None:
    from kvflow.router.degrade.ladder import Step

    ladder = {"steps": ["cap_max_tokens", "drop_extras", "fallback_model", "queue_with_deadline"],
              "slo": {"ttftTargetMs": 500, "tpotTargetMs": 50, "percentile": 95},
              "engageAfterSeconds": 5, "reengageWindowSeconds": 300, "maxTokensCap": 256,
              "fallbackModel": "smollm2-small",
              "queueDeadlineSeconds": 4}  # fmt: skip
    resolution = resolve(
        [
            model("smollm2", {"v1": 1}, aliases=["chat"], degradation=ladder),
            model("smollm2-small", {"v2": 1}),
            # A fallback this gateway does not serve: that step is left out, and reported.
            model("pinned", {"v2": 1}, degradation={**ladder, "fallbackModel": "gone"}),
        ],
        POOLS,
    )
    assert [p.reason for p in resolution.problems] == ["FallbackModelNotServed"]
    assert "'gone' is not served by this gateway" in resolution.problems[0].message
    spec = from_json(gw.InferenceGatewaySpec, {"router": {"redis": {"url": "redis://r:6379"}}})
    configmap, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, POOLS
    )
    config = parse_config(yaml.safe_load(configmap["data"][CONFIG_KEY]))
    big = config.degradation["smollm2"]
    assert big.names == {"smollm2", "chat"}
    assert big.ladder.steps == (Step.CAP_MAX_TOKENS, Step.DROP_EXTRAS, Step.FALLBACK_MODEL,
                                Step.QUEUE_WITH_DEADLINE)  # fmt: skip
    assert (big.targets.ttft_s, big.targets.tpot_s, big.targets.percentile) == (0.5, 0.05, 95)
    assert (big.ladder.engage_after_s, big.ladder.release_after_s) == (5, 30)  # the default
    assert (big.ladder.reengage_window_s, big.ladder.max_release_after_s) == (300, 480)
    assert big.ladder.release_offered_ratio == 0.0
    assert (big.max_tokens_cap, big.fallback_model, big.queue_deadline_s) == (
        256,
        "smollm2-small",
        4,
    )
    pinned = config.degradation["pinned"]
    assert Step.FALLBACK_MODEL not in pinned.ladder.steps and pinned.fallback_model is None
    assert "smollm2-small" not in config.degradation  # no ladder: never degraded


def test_the_router_reads_each_models_cascade() -> None:
    checks = {"minMeanLogprob": -1.5, "refusalPatterns": ["(?i)I can't help"]}
    cascade = {"small": "smollm2-small", "large": "smollm2", "checks": checks}
    resolution = resolve(
        [
            model("chat", {"v1": 1}, aliases=["assistant"], cascade=cascade),
            model("smollm2", {"v1": 1}),
            model("smollm2-small", {"v2": 1}),
            # A large model this gateway does not serve, a pattern that is no regex: both
            # cascades are left out (the router would refuse them), and reported.
            model("lost", {"v2": 1}, cascade={**cascade, "large": "gone"}),
            model("broken", {"v2": 1}, cascade={**cascade, "checks": {"refusalPatterns": ["("]}}),
        ],
        POOLS,
    )
    assert [p.reason for p in resolution.problems] == ["CascadeLeftOut", "CascadeLeftOut"]
    assert "cascade.large 'gone' is not served by this gateway" in resolution.problems[0].message
    assert "refusalPatterns[0] is not a valid regex" in resolution.problems[1].message
    spec = from_json(gw.InferenceGatewaySpec, {"router": {"redis": {"url": "redis://r:6379"}}})
    configmap, *_ = desired_gateway_children(
        GATEWAY, spec, Images(worker="w", router="r"), resolution, POOLS
    )
    config = parse_config(yaml.safe_load(configmap["data"][CONFIG_KEY]))
    assert set(config.cascade) == {"chat"}
    chat = config.cascade["chat"]
    assert chat.names == {"chat", "assistant"}
    assert (chat.small, chat.large) == ("smollm2-small", "smollm2")
    assert chat.checks.min_mean_logprob == -1.5 and chat.checks.json_when_response_format
    assert [p.pattern for p in chat.checks.refusal_patterns] == ["(?i)I can't help"]


def test_the_operator_names_every_step_the_router_has() -> None:
    """A step the router gains is named in the schema too."""
    from typing import get_args

    from kvflow.operator.api.v1alpha1_degradation import DegradationStep
    from kvflow.router.degrade.ladder import STEP_WORDS

    assert list(get_args(DegradationStep)) == list(STEP_WORDS)


def test_a_response_cache_step_needs_the_gateways_response_cache(tmp_path: Path) -> None:
    """The gateway's responseCache becomes the router's --response-cache flags, which the
    router accepts with a ladder naming response_cache; with it off the step is left out
    and reported, since the router would refuse the ladder."""
    from kvflow.router.degrade.ladder import Step

    ladder = {"steps": ["drop_extras", "response_cache"],
              "slo": {"ttftTargetMs": 500, "tpotTargetMs": 50}}  # fmt: skip
    models = [
        model("smollm2", {"v1": 1}, degradation=ladder),
        model("only-cache", {"v2": 1}, degradation={**ladder, "steps": ["response_cache"]}),
    ]
    on = {"enabled": True, "ttlSeconds": 60, "maxMib": 8, "maxEntryKib": 32}
    for cache, steps in (({}, None), (on, (Step.DROP_EXTRAS, Step.RESPONSE_CACHE))):
        spec = from_json(gw.InferenceGatewaySpec, {"router": {"responseCache": cache}})
        resolution = resolve(models, POOLS, response_cache=spec.router.response_cache.enabled)
        configmap, _, deployment, *_ = desired_gateway_children(
            GATEWAY, spec, Images(worker="w", router="r"), resolution, POOLS
        )
        written = tmp_path / CONFIG_KEY
        written.write_text(configmap["data"][CONFIG_KEY])
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        args = [str(written) if a.endswith(f"/{CONFIG_KEY}") else a for a in args[1:]]
        settings = parse_router_args(args, env={})
        assert settings is not None
        degradation = settings.config.degradation
        if steps is None:  # off: no flag, the step left out, a ladder of it alone dropped
            assert "--response-cache" not in args and not settings.response_cache.is_enabled
            assert degradation["smollm2"].ladder.steps == (Step.DROP_EXTRAS,)
            assert "only-cache" not in degradation
            assert [p.reason for p in resolution.problems] == ["ResponseCacheOff"] * 2
            assert "spec.router.responseCache.enabled" in resolution.problems[0].message
        else:
            cache_config = settings.response_cache
            assert cache_config.is_enabled and cache_config.ttl_s == 60
            assert (cache_config.max_mib, cache_config.max_entry_kib) == (8, 32)
            assert degradation["smollm2"].ladder.steps == steps
            assert degradation["only-cache"].ladder.steps == (Step.RESPONSE_CACHE,)
            assert not resolution.problems
