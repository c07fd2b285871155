"""An InferenceModel's automatic degradation, version v1alpha1 (docs/router.md, "When demand
exceeds supply"): the cheaper answers its gateway gives, one step at a time, while the
model's SLO burns, and takes back once it is calm.

The operator writes it into the gateway's router config (`degradation:`, the format of
kvflow.router.degrade.config; builders/gateway.py). What the router would refuse is refused
here first, by the schema and the CEL rules below, so a model cannot crash-loop its gateway;
a fallback model the gateway does not serve is dropped and reported (builders/
gateway_models.py), as is a response_cache step on a gateway whose router has its response
cache off (spec.router.responseCache). Pure: imports neither kopf nor kubernetes.
"""

# schema.field() is a documented dataclasses.field (it returns one); RUF009 cannot tell.
# ruff: noqa: RUF009

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvflow.operator.api.schema import CelRule, cel, field
from kvflow.operator.api.v1alpha1_planner import SloSpec

DegradationStep = Literal[
    "cap_max_tokens", "drop_extras", "fallback_model", "response_cache", "queue_with_deadline"
]
# The router's bound on queueDeadlineSeconds (kvflow.router.degrade.config).
MAX_QUEUE_DEADLINE_SECONDS = 300.0
_MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$"


def _needs(step: str, json_field: str) -> CelRule:
    return CelRule(
        f"!self.steps.exists(s, s == '{step}') || has(self.{json_field})",
        f"step {step} needs {json_field}",
        f".{json_field}",
    )


@cel(
    _needs("cap_max_tokens", "maxTokensCap"),
    _needs("fallback_model", "fallbackModel"),
    _needs("queue_with_deadline", "queueDeadlineSeconds"),
    CelRule(
        "self.releaseBurn <= self.engageBurn",
        "releaseBurn must be at most engageBurn",
        ".releaseBurn",
    ),
    CelRule(
        "self.releaseQueueSeconds <= self.engageQueueSeconds",
        "releaseQueueSeconds must be at most engageQueueSeconds",
        ".releaseQueueSeconds",
    ),
)
@dataclass(frozen=True)
class DegradationSpec:
    """Cheaper answers while the model's SLO burns. While a burn rate (the share of the
    window's requests over a target, per unit of error budget) is over engageBurn, or the
    queue time's P90 over engageQueueSeconds, for engageAfterSeconds, the next step is
    taken; while every signal is under its release threshold for releaseAfterSeconds, the
    last step taken is reverted. Each degraded response names its steps in the
    x-kvflow-degraded header."""

    steps: list[DegradationStep] = field(
        """The steps, in the order to take them: cap_max_tokens (at most maxTokensCap
        tokens per choice), drop_extras (no tools, structured output or logprobs),
        fallback_model (served by fallbackModel), queue_with_deadline (wait up to
        queueDeadlineSeconds for capacity instead of a 503), response_cache (a sampled
        request answered with its greedy twin's stored answer; needs the gateway's
        router.responseCache.enabled, or the step is left out and reported).""",
        min_items=1,
        max_items=5,
        list_set=True,
    )
    slo: SloSpec = field("The targets the burn rates are measured against.", SloSpec())
    window_seconds: float = field(
        "The recent requests the signals are computed over.", 30.0, minimum=1, maximum=3600
    )
    engage_burn: float = field("A burn rate over this is hot.", 2.0, minimum=0, maximum=1000)
    release_burn: float = field("Every burn rate under this is calm.", 0.5, minimum=0,
                                maximum=1000)  # fmt: skip
    engage_queue_seconds: float = field(
        "A queue time P90 over this is hot.", 2.0, minimum=0, maximum=3600
    )
    release_queue_seconds: float = field(
        "A queue time P90 under this is calm.", 0.5, minimum=0, maximum=3600
    )
    engage_after_seconds: float = field(
        "Hot this long: the next step is taken.", 10.0, minimum=0, maximum=3600
    )
    release_after_seconds: float = field(
        "Calm this long: the last step taken is reverted.", 30.0, minimum=0, maximum=3600
    )
    reengage_window_seconds: float = field(
        """A step taken again within this long of its release doubles its next release
        dwell (releaseAfterSeconds, then twice, four times ...): the calm that released it
        was the step's own doing. 0: never.""",
        120.0,
        minimum=0,
        maximum=3600,
    )
    max_release_after_seconds: float = field(
        "The longest release dwell the doubling reaches (never below releaseAfterSeconds).",
        480.0,
        minimum=0,
        maximum=3600,
    )
    release_offered_ratio: float = field(
        """A step is reverted only once the model's arrivals per second are under this share
        of what they were when the step was taken (or after maxReleaseAfterSeconds of calm):
        calm signals under a step may be the step's doing. 0 (the default): the load is not
        asked, so capacity the planner adds releases the steps after one calm dwell.""",
        0.0,
        minimum=0,
        maximum=1000,
    )
    min_requests: int = field(
        "Fewer requests in the window than this: the ladder holds (too few to judge).",
        5,
        minimum=1,
        maximum=1_000_000,
    )
    max_tokens_cap: int | None = field(
        "cap_max_tokens: the most tokens a choice may generate.", None, minimum=1,
        maximum=1_048_576,
    )  # fmt: skip
    fallback_model: str | None = field(
        """fallback_model: another model name the same gateway serves (an InferenceModel's
        modelName or alias, or a target pool's servedName), e.g. a smaller or quantized
        version. A tenant not allowed to use it keeps the model it asked for.""",
        None,
        max_length=128,
        pattern=_MODEL_NAME_PATTERN,
    )
    queue_deadline_seconds: float | None = field(
        "queue_with_deadline: the longest a request waits for capacity.",
        None,
        minimum=0,
        exclusive_minimum=True,
        maximum=MAX_QUEUE_DEADLINE_SECONDS,
    )
