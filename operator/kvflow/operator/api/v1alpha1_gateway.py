"""The InferenceGateway and InferenceModel APIs, version v1alpha1 (issue 10, "Many models
behind one gateway").

An InferenceGateway is a router (Deployment, Service, routing ConfigMap) that lives on its
own, so pools behind it can come and go (a canary retires the old pool without taking the
gateway down). An InferenceModel is one public model name on one gateway, split by weight
between InferencePools: owned by the team that owns the model, as in the Gateway API
Inference Extension's model objects. The operator renders the router's `pools:` and
`models:` config from them (builders/gateway.py). Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, cel, field
from kvflow.operator.api.v1alpha1_cascade import CascadeSpec
from kvflow.operator.api.v1alpha1_degradation import DegradationSpec
from kvflow.operator.api.v1alpha1_router import ROUTER_AUTH_RULES, RouterSpec
from kvflow.operator.api.v1alpha1_semantic_cache import ModelSemanticCache, SemanticCacheSpec
from kvflow.operator.api.v1alpha1_status import Condition

GATEWAY_KIND = "InferenceGateway"
GATEWAY_PLURAL = "inferencegateways"
GATEWAY_SINGULAR = "inferencegateway"
GATEWAY_SHORT_NAMES = ("kvgw",)
MODEL_KIND = "InferenceModel"
MODEL_PLURAL = "inferencemodels"
MODEL_SINGULAR = "inferencemodel"
MODEL_SHORT_NAMES = ("kvmodel",)

# A router rejects an all-zero split; a weight this large already expresses any canary.
MAX_WEIGHT = 1_000_000
MAX_TARGETS = 16
MAX_ALIASES = 16

# Like an InferencePool's servedName (it travels in every request body); empty allowed.
_MODEL_NAME_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9._:/-]*)?$"
_ALIAS_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"

GatewayPhase = Literal["Pending", "Progressing", "Ready", "Degraded"]


@dataclass(frozen=True)
class GatewayRef:
    """The InferenceGateway, in the model's namespace, that serves this model."""

    name: str = field("Name of the InferenceGateway.", min_length=1, max_length=253)


@dataclass(frozen=True)
class PoolRef:
    """An InferencePool in the model's namespace."""

    name: str = field("Name of the InferencePool.", min_length=1, max_length=253)


@dataclass(frozen=True)
class ModelTarget:
    """One pool that answers for the model, and its share of the requests."""

    pool_ref: PoolRef = field("The InferencePool.")
    weight: int = field(
        """Relative share of the model's requests this pool gets (a canary: 95 and 5). A
        client that sends a session header keeps the pool it drew.""",
        1,
        minimum=0,
        maximum=MAX_WEIGHT,
    )


@cel(
    CelRule(
        "self.targets.exists(t, t.weight > 0)",
        "at least one target needs a weight above 0",
        ".targets",
    ),
    CelRule(
        "self.targets.all(t, self.targets.exists_one(u, u.poolRef.name == t.poolRef.name))",
        "each pool may be a target once",
        ".targets",
    ),
    CelRule(
        "!has(self.aliases) || !self.aliases.exists(a, a == self.modelName)",
        "an alias must differ from modelName",
        ".aliases",
    ),
)
@dataclass(frozen=True)
class InferenceModelSpec:
    """A public model name on a gateway, split by weight between InferencePools."""

    gateway_ref: GatewayRef = field("The gateway that serves this model.")
    targets: list[ModelTarget] = field(
        "The pools that answer for the model, with their weights.",
        min_items=1,
        max_items=MAX_TARGETS,
    )
    model_name: str = field(
        """The name clients send as `model`. Empty: the object's name.""",
        "",
        max_length=128,
        pattern=_MODEL_NAME_PATTERN,
    )
    aliases: list[str] = field(
        "More names for the same model (e.g. chat).",
        [],
        max_items=MAX_ALIASES,
        list_set=True,
        item_pattern=_ALIAS_PATTERN,
        item_max_length=128,
    )
    degradation: DegradationSpec | None = field(
        """Cheaper answers while the model's SLO burns (docs/router.md, "When demand
        exceeds supply"). Unset: the model is never degraded.""",
        None,
    )
    cascade: CascadeSpec | None = field(
        """A small model answers first, a large one when a check fails (docs/router.md,
        "Model cascade"). Unset: this model's targets answer every request.""",
        None,
    )
    semantic_cache: ModelSemanticCache | None = field(
        """Opt in to the gateway's semantic cache (its spec.semanticCache; tenants opt in
        too). Unset: this model's prompts are never answered from near matches.""",
        None,
    )


@cel(*ROUTER_AUTH_RULES)
@dataclass(frozen=True)
class InferenceGatewaySpec:
    """An OpenAI-compatible gateway in front of the InferencePools its InferenceModels
    target, with a lifecycle independent of any pool."""

    router: RouterSpec = field(
        """The router replicas, image, Service, shared Redis, tenants and admission, as in
        an InferencePool. Its disaggregation policy is not used: each disaggregated pool
        brings its own.""",
        RouterSpec(),
    )
    semantic_cache: SemanticCacheSpec | None = field(
        """Near-match answers for the InferenceModels that opt in (docs/router.md,
        "Semantic cache"). Unset: off.""",
        None,
    )


@dataclass(frozen=True)
class ResolvedTarget:
    """A pool the gateway sends a model's requests to."""

    pool: str = field("The InferencePool.")
    weight: int = field("Its share.", 0)


@dataclass(frozen=True)
class ResolvedModel:
    """A public model name as the gateway serves it now."""

    name: str = field("The name clients send as `model`.")
    aliases: list[str] = field("More names for it.", [])
    targets: list[ResolvedTarget] = field("Pools that answer for it, with weights.", [])
    source: str = field("The InferenceModel it comes from.", "")


@dataclass(frozen=True)
class InferenceGatewayStatus:
    """What the operator observed and did (written by the operator only)."""

    phase: GatewayPhase = field("Pending, Progressing, Ready or Degraded.", "Pending")
    observed_generation: int = field("The spec generation last reconciled.", 0)
    conditions: list[Condition] = field(
        "Ready and Degraded (which names every problem).", [], map_keys=("type",)
    )
    desired_replicas: int = field("Router pods asked for.", 0)
    ready_replicas: int = field("Ready router pods.", 0)
    endpoint: str = field("In-cluster URL of the OpenAI API (.../v1).", "")
    models: list[ResolvedModel] = field(
        "The models the gateway serves, as written into its router config.", []
    )


@dataclass(frozen=True)
class InferenceModelStatus:
    """Whether a gateway serves the model (written by the operator only)."""

    observed_generation: int = field("The spec generation last reconciled.", 0)
    conditions: list[Condition] = field(
        """Accepted: the gateway serves the model (False: GatewayNotFound, NameConflict or
        NoTargetPool). ResolvedRefs: every target pool exists (False: TargetPoolMissing).""",
        [],
        map_keys=("type",),
    )
