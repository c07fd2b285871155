"""Which models a gateway serves, from its InferenceModels and the pools they target (pure).

The router refuses a config with a duplicate public name, a target naming an unknown pool,
two pools with one served name or an all-zero split, and a refused config is a crash-looping
gateway. So everything the router would refuse is left out here and reported instead: in
the gateway's status (Degraded) and in the status of the InferenceModel at fault. The older
InferenceModel keeps a contested name, so a newcomer cannot take a name that serves traffic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from kvflow.operator.api import v1alpha1
from kvflow.operator.api.schema import Json
from kvflow.operator.api.v1alpha1_cascade import CascadeSpec
from kvflow.operator.api.v1alpha1_degradation import DegradationSpec, DegradationStep
from kvflow.operator.api.v1alpha1_gateway import (
    InferenceModelSpec,
    ResolvedModel,
    ResolvedTarget,
)
from kvflow.operator.api.v1alpha1_semantic_cache import SemanticCacheSpec
from kvflow.operator.builders.gateway_semantic import semantic_cache_section

ModelReason = Literal["Accepted", "NameConflict", "NoTargetPool"]


@dataclass(frozen=True)
class GatewayProblem:
    """Something the gateway leaves out or cannot do; its status reports each."""

    reason: str  # CamelCase: NameConflict, TargetPoolMissing, ...
    message: str


@dataclass(frozen=True)
class ModelObject:
    """An InferenceModel as read: its object name and spec, oldest first in a list."""

    name: str
    spec: InferenceModelSpec

    @property
    def public_name(self) -> str:
        return self.spec.model_name or self.name


@dataclass(frozen=True)
class ModelVerdict:
    """What became of one InferenceModel (its Accepted and ResolvedRefs conditions)."""

    accepted: bool
    reason: ModelReason
    message: str
    missing_pools: tuple[str, ...] = ()  # targets dropped: no such pool, or a served-name clash


@dataclass(frozen=True)
class Resolution:
    models: tuple[ResolvedModel, ...]  # what the router config's `models:` says
    pools: tuple[str, ...]  # pools any served model targets, sorted
    verdicts: Mapping[str, ModelVerdict]  # by InferenceModel name
    problems: tuple[GatewayProblem, ...]  # for the gateway's Degraded condition
    # Public model name -> its degradation ladder, for the router config's `degradation:`.
    degradations: Mapping[str, DegradationSpec] = field(default_factory=dict)
    # Public model name -> its cascade, for the router config's `cascade:`.
    cascades: Mapping[str, CascadeSpec] = field(default_factory=dict)
    # The router config's `semantic_cache:` section; None: left out.
    semantic_cache: Mapping[str, Json] | None = None


def resolve(
    models: Sequence[ModelObject],
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
    *,
    response_cache: bool = False,
    semantic_cache: SemanticCacheSpec | None = None,
) -> Resolution:
    """`models`: the InferenceModels naming the gateway, oldest first. `pools`: the
    InferencePools of the namespace that can be read, by name. `response_cache`: the
    gateway's router has its response cache on (a ladder's response_cache step needs it).
    `semantic_cache`: the gateway's (gateway_semantic.py)."""
    taken: dict[str, str] = {}  # public name -> InferenceModel holding it
    served_by: dict[str, str] = {}  # served name -> the pool (in use) that serves it
    resolved: list[ResolvedModel] = []
    verdicts: dict[str, ModelVerdict] = {}
    problems: list[GatewayProblem] = []
    for model in models:
        names = [model.public_name, *model.spec.aliases]
        clash = next((n for n in names if n in taken), None)
        if clash is not None:
            message = f"name {clash!r} is already served for InferenceModel {taken[clash]}"
            verdicts[model.name] = ModelVerdict(False, "NameConflict", message)
            problems.append(
                GatewayProblem("NameConflict", f"InferenceModel {model.name}: {message}")
            )
            continue
        targets, missing, why = _targets(model, pools, served_by)
        problems += [GatewayProblem(r, f"InferenceModel {model.name}: {w}") for r, w in why]
        if sum(t.weight for t in targets) == 0:
            message = "no target pool with a weight above 0 exists"
            if why:
                message += f" ({'; '.join(w for _, w in why)})"
            verdicts[model.name] = ModelVerdict(False, "NoTargetPool", message, missing)
            continue
        for target in targets:
            served_by.setdefault(pools[target.pool].model.served_name, target.pool)
        taken.update({n: model.name for n in names})
        resolved.append(
            ResolvedModel(
                name=model.public_name,
                aliases=list(model.spec.aliases),
                targets=targets,
                source=model.name,
            )
        )
        verdicts[model.name] = ModelVerdict(True, "Accepted", "; ".join(w for _, w in why), missing)
    used = sorted({t.pool for m in resolved for t in m.targets})
    served = {n for m in resolved for n in (m.name, *m.aliases)}
    served |= {pools[p].model.served_name for p in used}
    accepted = [m for m in models if verdicts[m.name].accepted]
    degradations = _degradations(accepted, served, problems, response_cache=response_cache)
    cascades = _cascades(accepted, served, problems)
    generating = {
        *degradations,
        *cascades,
        *(n for c in cascades.values() for n in (c.small, c.large)),
    }
    opt_ins = {m.name: m.spec for m in accepted if m.spec.semantic_cache is not None}
    section, why = semantic_cache_section(semantic_cache, opt_ins, resolved, pools, generating)
    problems += [GatewayProblem(reason, message) for reason, message in why]
    return Resolution(tuple(resolved), tuple(used), verdicts, tuple(problems), degradations,
                      cascades, section)  # fmt: skip


def _cascades(
    models: Sequence[ModelObject], served: set[str], problems: list[GatewayProblem]
) -> dict[str, CascadeSpec]:
    """The accepted models' cascades. The router refuses a small or large model it does not
    serve (or the model itself) and a pattern that is not a regex: that cascade is left out
    and reported, and the model's own targets answer it."""
    out: dict[str, CascadeSpec] = {}
    for model in models:
        spec = model.spec.cascade
        if spec is None:
            continue
        own = {model.public_name, *model.spec.aliases}
        why = []
        for role, name in (("small", spec.small), ("large", spec.large)):
            if name in own or name not in served:
                what = "is the model itself" if name in own else "is not served by this gateway"
                why.append(f"cascade.{role} {name!r} {what}")
        for i, pattern in enumerate(spec.checks.refusal_patterns):
            try:
                re.compile(pattern)
            except re.error as exc:
                why.append(f"cascade.checks.refusalPatterns[{i}] is not a valid regex: {exc}")
        if why:
            problems.append(GatewayProblem(
                "CascadeLeftOut",
                f"InferenceModel {model.name}: {'; '.join(why)}; its cascade is left out",
            ))  # fmt: skip
            continue
        out[model.public_name] = spec
    return out


def _degradations(
    models: Sequence[ModelObject],
    served: set[str],
    problems: list[GatewayProblem],
    *,
    response_cache: bool,
) -> dict[str, DegradationSpec]:
    """The accepted models' ladders. The router refuses a fallback it does not serve (or
    the model itself), and a response_cache step with its response cache off: such a step
    is left out and reported, the rest of the ladder kept."""
    out: dict[str, DegradationSpec] = {}
    for model in models:
        spec = model.spec.degradation
        if spec is None:
            continue
        fallback = spec.fallback_model
        own = {model.public_name, *model.spec.aliases}
        if fallback is not None and (fallback not in served or fallback in own):
            why = "is the model itself" if fallback in own else "is not served by this gateway"
            problems.append(GatewayProblem(
                "FallbackModelNotServed",
                f"InferenceModel {model.name}: degradation.fallbackModel {fallback!r} {why}; "
                "its fallback_model step is left out",
            ))  # fmt: skip
            steps: list[DegradationStep] = [s for s in spec.steps if s != "fallback_model"]
            spec = replace(spec, steps=steps, fallback_model=None)
        if "response_cache" in spec.steps and not response_cache:
            problems.append(GatewayProblem(
                "ResponseCacheOff",
                f"InferenceModel {model.name}: degradation step response_cache needs the "
                "gateway's spec.router.responseCache.enabled; the step is left out",
            ))  # fmt: skip
            spec = replace(spec, steps=[s for s in spec.steps if s != "response_cache"])
        if not spec.steps:
            continue
        out[model.public_name] = spec
    return out


def _targets(
    model: ModelObject,
    pools: Mapping[str, v1alpha1.InferencePoolSpec],
    served_by: Mapping[str, str],
) -> tuple[list[ResolvedTarget], tuple[str, ...], list[tuple[str, str]]]:
    """The targets the router can take, the pools dropped, and why each was."""
    targets: list[ResolvedTarget] = []
    missing: list[str] = []
    why: list[tuple[str, str]] = []  # (reason, message)
    served_by = dict(served_by)  # and this model's own targets so far
    for target in model.spec.targets:
        pool = target.pool_ref.name
        spec = pools.get(pool)
        if spec is None:
            missing.append(pool)
            why.append(("TargetPoolMissing", f"target pool {pool} does not exist"))
            continue
        owner = served_by.get(spec.model.served_name, pool)
        if owner != pool:
            missing.append(pool)
            why.append((
                "ServedNameConflict",
                f"target pool {pool} serves {spec.model.served_name!r}, as pool {owner} "
                "already does on this gateway",
            ))  # fmt: skip
            continue
        served_by[spec.model.served_name] = pool
        targets.append(ResolvedTarget(pool=pool, weight=target.weight))
    return targets, tuple(missing), why
