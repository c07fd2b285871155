"""What a request asks of the generation service, and what it reports back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.responses import UsageCounts
from kvflow.router.tenants.config import Tenant


@dataclass(frozen=True)
class ChoiceSpec:
    index: int
    prompt_index: int  # which prompt (usage counts each prompt once, as OpenAI bills it)
    prompt_token_ids: list[int]
    sampling: pb.SamplingParams
    stop_strings: tuple[str, ...]
    num_top_logprobs: int


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    model: str
    session_id: str | None = None


@dataclass(frozen=True)
class ChoiceUsage:
    index: int
    prompt_index: int
    usage: UsageCounts


@dataclass
class RequestTrace:
    """What happened to a request, for headers and metrics."""

    arrival_s: float = field(default_factory=time.perf_counter)
    routes: list[str] = field(default_factory=list)
    first_token_s: float | None = None
