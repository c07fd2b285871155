"""A request's state as the scheduler and the KV cache see it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.priority_class import PriorityClass


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # waiting again; its KV is dropped and will be recomputed
    # PD, decode side: blocks reserved for KV a prefill worker computes; not scheduled
    # until they land (or the transfer fails and the request computes them itself).
    WAITING_FOR_REMOTE_KV = enum.auto()
    # PD, prefill side: every block computed; held until they have been sent.
    SENDING_KV = enum.auto()
    FINISHED = enum.auto()


@dataclass(frozen=True, slots=True)
class KvBlockRange:
    """Prompt positions [first_token, end_token), both multiples of the block size, and
    the blocks that hold them (PD: what a decode worker reserved or a prefill worker sends)."""

    first_token: int
    end_token: int
    block_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.first_token


@dataclass(eq=False)
class Request:
    """One generation. ``token_ids`` is the prompt followed by the outputs so far.

    The scheduler plans in tokens: a step computes ``num_new`` of the tokens after
    ``num_computed_tokens``; prefill, chunked prefill, prefix hits and decode are all
    that one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time_s: float
    cache_salt: str = ""
    num_public_blocks: int = 0
    priority: int = 0  # lower runs first within a tenant; a weight across tenants
    # Whose share of the worker this request uses (fair_queue.py); the cache salt when the
    # caller names none, which the router makes unique per tenant.
    tenant: str = ""
    # Above tenants' shares: the scheduler runs a more urgent class first and preempts a less
    # urgent one's KV before its own (kvflow.proto.priority_class).
    priority_class: PriorityClass = PriorityClass.NORMAL
    # PD, decode side: wait for a prefill worker to send the prompt blocks this worker lacks.
    wants_remote_kv: bool = False
    # PD, prefill side: compute the prompt's KV (no sampling), then send blocks from this
    # token on; None for every other request.
    send_from_token: int | None = None

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_remote_tokens: int = 0  # prompt tokens whose KV a prefill worker sent (PD)
    kv_range: KvBlockRange | None = None  # PD: reserved (decode) or to send (prefill)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks, grows
    num_preemptions: int = 0
    first_scheduled_time_s: float | None = None
    first_token_time_s: float | None = None
    finished_time_s: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_prefill_only(self) -> bool:
        return self.send_from_token is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float, str]:
        """Priority, then first come first served; the id breaks exact ties."""
        return (self.priority, self.arrival_time_s, self.request_id)
