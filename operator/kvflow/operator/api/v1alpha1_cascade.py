"""An InferenceModel's model cascade, version v1alpha1 (docs/router.md, "Model cascade"): a
small model answers first, and its answer goes to a large model when a check fails.

The operator writes it into the gateway's router config (`cascade:`, the format of
kvflow.router.cascade.config; builders/gateway.py). What the router would refuse is refused
here first by the schema and the CEL rule below; a cascade naming a model the gateway does
not serve, or a refusal pattern that is not a valid regex, is left out and reported
(builders/gateway_models.py), so a model cannot crash-loop its gateway.
Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass

from kvflow.operator.api.schema import CelRule, cel, field

_MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"
# The router's bounds (kvflow.router.cascade.config): patterns run on every small answer.
MAX_REFUSAL_PATTERNS = 32
MAX_REFUSAL_PATTERN_CHARS = 512


@cel(
    CelRule(
        "!has(self.refusalPatterns) || self.refusalPatterns.all(p, size(p) > 0)",
        "a refusal pattern must not be empty (it would match every answer)",
        ".refusalPatterns",
    )
)
@dataclass(frozen=True)
class CascadeChecksSpec:
    """What a small answer must pass to be sent as it is; each failure escalates."""

    min_mean_logprob: float | None = field(
        """Escalate when the mean logprob of a choice's tokens is under this (e.g. -1.5).
        Unset: the logprob check is off.""",
        None,
        minimum=-1000,
        maximum=0,
    )
    json_when_response_format: bool = field(
        """Escalate an answer that is not valid JSON when the request asked for JSON
        (response_format json_object or json_schema).""",
        True,
    )
    refusal_patterns: list[str] = field(
        "Escalate an answer matching one of these Python regexes (searched anywhere).",
        [],
        max_items=MAX_REFUSAL_PATTERNS,
        item_max_length=MAX_REFUSAL_PATTERN_CHARS,
    )


@cel(CelRule("self.small != self.large", "small and large must be two models", ".large"))
@dataclass(frozen=True)
class CascadeSpec:
    """The small model answers every request first, in full; the large one answers instead
    when a check fails. Each response says which in its x-kvflow-cascade header. A tenant
    not allowed both models gets this model's own targets."""

    small: str = field(
        """The model that answers first: another model name the same gateway serves (an
        InferenceModel's modelName or alias, or a target pool's servedName).""",
        max_length=128,
        pattern=_MODEL_NAME_PATTERN,
    )
    large: str = field(
        "The model that answers when the small model's answer fails a check.",
        max_length=128,
        pattern=_MODEL_NAME_PATTERN,
    )
    checks: CascadeChecksSpec = field(
        "When the small model's answer is escalated.", CascadeChecksSpec()
    )
