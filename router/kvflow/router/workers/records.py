"""Typed records between serving and a worker's gRPC calls: what to run, what comes back.

No protobuf here: workers/convert.py converts both ways, once, so the serving and HTTP
layers never build or read wire messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvflow.proto.priority_class import PriorityClass
from kvflow.router.protocol.requests import SamplingOptions

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class WorkerContext:
    """Who a request runs for and what of a worker it may share (the wire's RequestContext):
    one value for a choice's generate and prefill requests alike."""

    cache_salt: str
    priority: int = 0
    num_public_blocks: int = 0
    tenant: str = ""  # keys the workers' fair sharing; empty: the cache salt does
    priority_class: PriorityClass = PriorityClass.NORMAL  # ranks above the tenants' shares


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """One attempt at one choice, on one worker."""

    request_id: str  # unique on the worker: "<request id>-c<choice>-a<attempt>"
    prompt_token_ids: Sequence[int]
    sampling: SamplingOptions  # `seed` already this choice's own
    context: WorkerContext
    # Set on the decode half of a disaggregated plan: the worker reserves the blocks it
    # lacks, answers with a KvReservation first, and waits this long for them.
    remote_prefill_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    logprob: float
    top_token_ids: Sequence[int]
    top_logprobs: Sequence[float]


@dataclass(frozen=True, slots=True)
class WorkerUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # from the worker's own prefix cache
    remote_tokens: int  # whose KV a prefill worker sent


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens since the previous chunk; the last chunk has the finish reason and usage."""

    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprobs]
    finish_reason: FinishReason | None = None
    usage: WorkerUsage | None = None


@dataclass(frozen=True, slots=True)
class KvReservation:
    """A decode worker's reserved blocks for prompt positions [first_token, end_token).

    ``wire`` is the worker's message, serialized: the router hands it to the prefill worker
    verbatim and reads nothing else of it.
    """

    first_token: int
    end_token: int
    wire: bytes

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.first_token


@dataclass(frozen=True, slots=True)
class PrefillInput:
    request_id: str
    prompt_token_ids: Sequence[int]  # the whole prompt: hashes need every block
    context: WorkerContext


@dataclass(frozen=True, slots=True)
class PrefillResult:
    num_computed_tokens: int
    num_cached_tokens: int
    num_sent_blocks: int
    num_sent_bytes: int
    queued_s: float
    prefill_s: float
    transfer_s: float
