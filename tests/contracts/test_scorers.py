"""The CRD's scorer weights name the router's scorers: one name on both sides.

`router.scorerWeights` in an InferencePool or InferenceGateway holds one field per routing
scorer; the operator writes each set field into the router's `routing.weights` under the
field's snake_case name, untranslated. These tests hold the CRD's fields to the router's
scorer registry and feed the operator's output to the router's own parser and pipeline.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import yaml

from kvflow.operator.api import v1alpha1, v1alpha1_router
from kvflow.operator.api.schema import camel, from_json, json_name
from kvflow.operator.builders.router import router_config
from kvflow.proto.block_hash import block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import (
    BLOCK_WEIGHTS,
    DEFAULT_WEIGHTS,
    SCORER_ALIASES,
    SCORERS,
    build_pipeline,
)
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView
from kvflow.router.settings import parse_config

FIELDS = dataclasses.fields(v1alpha1_router.ScorerWeights)


def rendered_weights(scorer_weights: dict[str, Any]) -> dict[str, float]:
    """The router's weights, parsed by the router, from what the operator renders."""
    spec = from_json(
        v1alpha1.InferencePoolSpec,
        {"model": {"servedName": "m"}, "router": {"scorerWeights": scorer_weights}},
    )
    text = yaml.safe_dump(router_config(spec))
    return dict(parse_config(yaml.safe_load(text)).weights)


def test_each_field_is_a_registered_scorer_under_its_snake_case_name() -> None:
    assert FIELDS, "ScorerWeights has no fields"
    for f in FIELDS:
        assert json_name(f) == camel(f.name), f"{f.name}: the CRD name is not its camelCase"
        assert f.name in SCORERS, f"scorerWeights.{json_name(f)} names no router scorer"
        assert f.name not in SCORER_ALIASES, f"{f.name} is only an alias on the router"


@pytest.mark.parametrize("f", FIELDS, ids=json_name)
def test_a_field_set_alone_weighs_the_scorer_of_its_name(f: dataclasses.Field[Any]) -> None:
    weights = rendered_weights({json_name(f): 7.5})
    assert weights[f.name] == 7.5
    assert set(weights) <= set(SCORERS)
    # The router's pipeline runs that scorer: its value explains the route.
    pipeline = build_pipeline(
        weights, index=BlockIndex(), sessions=SessionTable(), rng=random.Random(0)
    )
    seed = make_hash_seed("m")
    request = RouteRequest(
        model="m", block_hashes=block_hashes(list(range(32)), block_size=16, seed=seed)
    )
    worker = WorkerView(WorkerId("a"), "m", Role.COLOCATED, True, 0, 0.0)
    decision = pipeline.route(request, [worker])
    assert decision is not None and f.name in decision.scores


def test_all_fields_set_reach_the_router_as_they_are() -> None:
    every = {json_name(f): float(i + 1) for i, f in enumerate(FIELDS)}
    weights = rendered_weights(every)
    assert {name: weights[name] for name in (f.name for f in FIELDS)} == {
        f.name: float(i + 1) for i, f in enumerate(FIELDS)
    }
    assert set(weights) == {f.name for f in FIELDS}


@pytest.mark.parametrize(
    ("scorer_weights", "policy"),
    [
        ({}, DEFAULT_WEIGHTS),
        ({"session": 0.05}, DEFAULT_WEIGHTS),
        ({"queueDepth": 2.0}, BLOCK_WEIGHTS),
        ({"kvCacheUsage": 1.0, "timeCost": 0.0}, BLOCK_WEIGHTS),
        ({"prefixCache": 2.0, "timeCost": 1.0}, DEFAULT_WEIGHTS),
    ],
)
def test_the_fields_set_choose_the_routers_policy(
    scorer_weights: dict[str, float], policy: dict[str, float]
) -> None:
    # Unset: the time-based default; a block weight without timeCost: the block policy.
    # The unset weights are the chosen policy's; the set ones are as written.
    snake = {f.name: scorer_weights[json_name(f)] for f in FIELDS if json_name(f) in scorer_weights}
    assert rendered_weights(scorer_weights) == {**policy, **snake}
