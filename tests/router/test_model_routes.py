"""Public model names -> pools (models/routes.py) and the `pools:`/`models:` config
(models/pools.py): names, aliases, weighted draws, session draws, errors naming the field."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvflow.router.models.routes import ModelEntry, Target, session_draw
from kvflow.router.settings import ConfigError, parse_config

POOLS = [
    {"name": "smollm-v1", "served_model_name": "smollm2-v1", "workers": ["127.0.0.1:1"]},
    {"name": "smollm-v2", "served_model_name": "smollm2-v2", "worker_dns": "w.svc:50051",
     "disaggregation": {"min_remote_prefill_tokens": 7}},
]  # fmt: skip
MODELS = [
    {"name": "smollm2", "aliases": ["chat"],
     "targets": [{"pool": "smollm-v1", "weight": 95}, {"pool": "smollm-v2", "weight": 5}]},
    {"name": "smollm2-v1", "targets": [{"pool": "smollm-v2", "weight": 1}]},  # shadows
]  # fmt: skip
SERVED = {"smollm-v1": "smollm2-v1", "smollm-v2": "smollm2-v2"}


def config(**overrides: Any) -> dict[str, Any]:
    return {"pools": POOLS, "models": MODELS, **overrides}


def test_pools_parse_with_their_own_disaggregation_over_the_top_level() -> None:
    parsed = parse_config(config(disaggregation={"max_prefill_queue_depth": 3}))
    v1, v2 = parsed.pools
    assert (v1.name, v1.served_model_name, v1.workers, v1.worker_dns) == (
        "smollm-v1", "smollm2-v1", ("127.0.0.1:1",), None)  # fmt: skip
    assert v2.worker_dns == "w.svc:50051" and v2.workers == ()
    assert v1.disaggregation.max_prefill_queue_depth == 3  # the top level's
    assert v2.disaggregation.max_prefill_queue_depth == 3
    assert v2.disaggregation.min_remote_prefill_tokens == 7  # its own
    assert v1.disaggregation.min_remote_prefill_tokens == 512


def test_public_names_are_entries_aliases_and_served_names() -> None:
    routes = parse_config(config()).models
    assert routes.public_names(SERVED) == ["chat", "smollm2", "smollm2-v1", "smollm2-v2"]
    # A served name not known yet (no served_model_name, no worker reported) is not listed.
    assert routes.public_names({"smollm-v1": "smollm2-v1"}) == ["chat", "smollm2", "smollm2-v1"]


def test_resolve_by_name_alias_pinned_version_and_shadowing() -> None:
    routes = parse_config(config()).models
    assert routes.resolve("smollm2", 0.0, SERVED) == "smollm-v1"
    assert routes.resolve("chat", 0.9499, SERVED) == "smollm-v1"
    assert routes.resolve("chat", 0.95, SERVED) == "smollm-v2"
    assert routes.resolve("smollm2-v2", 0.0, SERVED) == "smollm-v2"  # a pinned version
    # The entry named smollm2-v1 wins over pool smollm-v1's served name.
    assert routes.resolve("smollm2-v1", 0.0, SERVED) == "smollm-v2"
    assert routes.resolve("gpt-4", 0.0, SERVED) is None


def test_without_models_each_pool_answers_to_its_served_name() -> None:
    routes = parse_config({"pools": POOLS}).models
    assert routes.public_names(SERVED) == ["smollm2-v1", "smollm2-v2"]
    assert routes.resolve("smollm2-v2", 0.3, SERVED) == "smollm-v2"


def test_weighted_pick_follows_the_cumulative_weights_and_skips_zero() -> None:
    entry = ModelEntry("m", (), (Target("a", 0), Target("b", 3), Target("c", 1), Target("d", 0)))
    assert [entry.pick(x / 8) for x in range(8)] == ["b"] * 6 + ["c"] * 2
    assert entry.pick(0.9999999999999999) == "c"
    counts = {"b": 0, "c": 0}
    rng = random.Random(0)
    for _ in range(4000):
        counts[entry.pick(rng.random())] += 1
    assert 2800 < counts["b"] < 3200  # 3000 expected; sd 27


def test_a_target_that_cannot_serve_gives_its_share_to_those_that_can() -> None:
    entry = ModelEntry("m", (), (Target("v1", 90), Target("canary", 10), Target("v3", 0)))

    def up(pool: str) -> bool:
        return pool != "canary"

    # Every draw, the canary's 10 % included, lands on v1 (never on a weight-0 target).
    assert {entry.pick(x / 100, up) for x in range(100)} == {"v1"}
    # v1 down: the canary takes everything.
    assert {entry.pick(x / 100, lambda pool: pool != "v1") for x in range(100)} == {"canary"}
    # Nothing serves: the draw is the plain weighted one (that pool's 503 names it).
    assert entry.pick(0.95, lambda pool: False) == "canary"
    routes = parse_config(config()).models
    assert routes.resolve("smollm2", 0.97, SERVED, lambda pool: pool != "smollm-v2") == "smollm-v1"


def test_a_session_draw_is_stable_and_spread() -> None:
    assert session_draw("user-42") == session_draw("user-42")
    draws = [session_draw(f"s{i}") for i in range(2000)]
    assert all(0 <= d < 1 for d in draws)
    assert 900 < sum(d < 0.5 for d in draws) < 1100
    # Pinned, so a change of hash (which would move every session's version) fails here.
    assert session_draw("user-42") == pytest.approx(0.42788, abs=1e-5)


@pytest.mark.parametrize(
    ("models", "field"),
    [
        ([{"name": "x", "targets": [{"pool": "nope", "weight": 1}]}], "models[0].targets[0].pool"),
        ([MODELS[0], {"name": "y", "targets": [{"pool": "smollm-v1", "weight": -1}]}],
         "models[1].targets[0].weight"),
        ([{"name": "x", "targets": [{"pool": "smollm-v1", "weight": 0}]}], "models[0].targets"),
        ([{"name": "x", "targets": []}], "models[0].targets"),
        ([{"name": "x", "targets": [{"pool": "smollm-v1", "weight": 1.5}]}],
         "models[0].targets[0].weight"),
        ([MODELS[0], {"name": "chat", "targets": [{"pool": "smollm-v1"}]}], "models[1].name"),
        ([MODELS[0], {"name": "z", "aliases": ["smollm2"], "targets": [{"pool": "smollm-v1"}]}],
         "models[1].aliases[0]"),
        ([{"name": "", "targets": [{"pool": "smollm-v1"}]}], "models[0].name"),
        ([{"name": "x", "target": []}], "models[0]"),
    ],
)  # fmt: skip
def test_bad_models_name_the_field(models: list[Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(models=models))
    assert str(caught.value).startswith(field), caught.value


@pytest.mark.parametrize(
    ("pools", "field"),
    [
        ([{"name": "Bad_Name", "workers": ["a:1"]}], "pools[0].name"),
        ([{"name": "a"}], "pools[0] needs exactly one"),
        ([{"name": "a", "workers": ["a:1"], "worker_dns": "b:2"}], "pools[0] needs exactly one"),
        ([{"name": "a", "workers": ["nope"]}], "pools[0].workers[0]"),
        ([{"name": "a", "workers": ["a:1"]}, {"name": "a", "workers": ["a:2"]}], "pools[1].name"),
        ([POOLS[0], {**POOLS[1], "served_model_name": "smollm2-v1"}],
         "pools[1].served_model_name"),
        ([{"name": "a", "workers": ["a:1"], "disaggregation": {"enabled": 1}}],
         "pools[0].disaggregation.enabled"),
        ([], "pools must be"),
    ],
)  # fmt: skip
def test_bad_pools_name_the_field(pools: list[Any], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"pools": pools})
    assert str(caught.value).startswith(field), caught.value


def test_models_without_pools_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs a pools section"):
        parse_config({"models": MODELS})
