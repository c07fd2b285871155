"""What a request asks of the generation service, and what it reports back."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kvflow.proto.priority_class import PriorityClass
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.protocol.responses import UsageCounts
from kvflow.router.tenants.config import Tenant


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_index: int  # which prompt (usage counts each prompt once, as OpenAI bills it)
    prompt_token_ids: list[int]
    # This choice's own: with n > 1 and a seed, choice j of a prompt samples with seed + j.
    sampling: SamplingOptions


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    # The name the pool's workers serve the model as (never the client's alias): what the
    # workers are asked for, and the latency histograms' `model` label.
    model: str
    session_id: str | None = None
    # The class the request runs as, already capped to the tenant's ceiling.
    priority_class: PriorityClass = PriorityClass.NORMAL

    @property
    def session_key(self) -> str | None:
        """The sticky session's key in the router's table: the client's session id under
        its tenant, so one tenant sending another's id moves nothing of the other's.
        (Tenant names hold no ':', tenants/config.py.)"""
        return None if not self.session_id else f"{self.tenant.name}:{self.session_id}"


@dataclass(frozen=True)
class ChoiceUsage:
    index: int
    prompt_index: int
    usage: UsageCounts


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


@dataclass
class RequestTrace:
    """What happened to a request, for headers, logs and metrics."""

    # The request's id for its caller: from `x-request-id` or made here; the response
    # header, log lines and traces carry it.
    request_id: str = field(default_factory=new_request_id)
    # The id workers see, always made here: a caller's id is no worker's business, and a
    # reused one must not collide there. Suffixed per choice and attempt ("<id>-c0-a1").
    # Equal to request_id when the caller sent none.
    server_id: str = field(default_factory=new_request_id)
    arrival_s: float = field(default_factory=time.perf_counter)
    routes: list[str] = field(default_factory=list)
    first_token_s: float | None = None
    # Admission control let it in and counts it in flight (api/completions.py, before its
    # prompts were prepared); the generation service need not check it again.
    is_admitted: bool = False
    # Choice index -> the completion tokens a buffered (non-streamed) choice's current
    # attempt has received and holds until it ends: what it computed, if the client leaves
    # before (api/accounting.py charges a request cut short).
    buffered_tokens: dict[int, int] = field(default_factory=dict)

    def attempt_id(self, choice: int, attempt: int) -> str:
        """The id a worker sees: unique per choice and attempt, so never twice on a worker."""
        return f"{self.server_id}-c{choice}-a{attempt}"
