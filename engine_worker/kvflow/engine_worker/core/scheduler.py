"""Continuous batching planned in tokens (STYLE.md, item 3).

Every step hands out at most ``max_num_batched_tokens`` tokens. A running request asks for
all its uncomputed tokens (one, when decoding; the rest of its prompt, when prefilling) and
gets what the budget allows, which is chunked prefill. Waiting requests are admitted in
priority order, then first come first served, after their cached prefix is subtracted.
When blocks run out, the lowest-priority, latest-arrived running request is preempted: its
blocks are freed and it waits again to be recomputed (its cached blocks often survive).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.kv_cache_manager import KVCacheManager
from kvflow.engine_worker.core.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` after ``num_computed_tokens``."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens and so samples one more."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class _WaitingQueue:
    """Requests ordered by (priority, arrival, id); a heap, so push and pop are O(log n)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(), request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[1] for item in self._heap)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = _WaitingQueue()
        self.running: list[Request] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request wherever it is and free its blocks (used for aborts too)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self, now_s: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running requests first, in admission order; preempt from the back when full.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new >= 1, "a running request always has a token to compute"
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = max(self.running[i:], key=Request.sort_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                i += 1

        # Admit waiting requests, unless this step had to preempt (memory is tight).
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                break  # head-of-line blocking keeps priority order
            self.waiting.pop()
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_hit_tokens
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = now_s
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return out

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request,
            request.num_computed_tokens,
            num_new,
            self.kv_cache.block_ids(request.request_id),
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.push(request)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Account the tokens a step computed (sampled tokens are appended by the engine)."""
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
