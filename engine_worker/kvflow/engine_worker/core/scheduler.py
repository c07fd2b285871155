"""Continuous batching planned in tokens (STYLE.md, item 3).

Every step hands out at most ``max_num_batched_tokens`` tokens. A running request asks for
all its uncomputed tokens (one, when decoding; the rest of its prompt, when prefilling) and
gets what the budget allows, which is chunked prefill. Waiting requests are admitted in
a fair order across tenants (fair_queue.py: the least-served backlogged tenant next,
weighted by priority), and within a tenant by priority then first come first served, after
their cached prefix is subtracted. When blocks run out, the latest request of the running
tenant served most is preempted: its blocks are freed and it waits again to be recomputed
(its cached blocks often survive).

A request's priority class (realtime, normal, batch; kvflow.proto.priority_class) ranks
above all of that. Running requests are served the step's budget class by class (admission
order within one), waiting requests are admitted class by class (fair_queue.py), and a
preemption's victim is the least urgent class's first, then the order above. A waiting
request may take blocks or a seat from a running request of a less urgent class only: a
realtime request that finds the worker full of batch work preempts batch requests until it
fits (they recompute later, as any preempted request does), where a request of the same
class waits its turn. ``preemptions_by_class`` counts the victims by class.

Prefill/decode disaggregation adds two states outside the running list. A decode-side
request that wants remote KV is admitted by reserving blocks for the prompt part it lacks
and then waits, unscheduled, until the blocks land (``remote_kv_landed``) or the transfer
fails (``remote_kv_failed``: it computes them itself). A prefill-side request runs like any
other but samples nothing; once its prompt is computed it leaves the running list and holds
its blocks until they are sent (``finish``). Both count against ``max_num_seqs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.engine_worker.core.block_pool import KVCacheBlock
from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.fair_queue import FairWaitingQueue
from kvflow.engine_worker.core.kv_cache_manager import KVCacheManager
from kvflow.engine_worker.core.request import FinishReason, KvBlockRange, Request, RequestStatus
from kvflow.proto.priority_class import PriorityClass

_CLASSES_BY_URGENCY = tuple(sorted(PriorityClass, key=lambda c: c.rank))


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` after ``num_computed_tokens``."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens and so samples one more
        (a prefill-only request never samples: its decode worker does)."""
        return (
            self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens
            and not self.request.is_prefill_only
        )


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    reserved: list[Request] = field(default_factory=list)  # PD decode: kv_range reserved
    kv_ready: list[Request] = field(default_factory=list)  # PD prefill: kv_range computed

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = FairWaitingQueue()
        self.num_admitted = 0  # requests that left the waiting queue, ever (drain rate)
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.sending: dict[str, Request] = {}
        # Requests preempted, ever, by the victim's class (the worker's metrics read it).
        self.preemptions_by_class: dict[PriorityClass, int] = dict.fromkeys(PriorityClass, 0)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_kv_transfers(self) -> int:
        return len(self.waiting_for_kv) + len(self.sending)

    @property
    def has_work(self) -> bool:
        """Whether a step could do something (requests in transfer wait for an event)."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request wherever it is and free its blocks (used for aborts too)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_kv[request.request_id]
        elif request.status is RequestStatus.SENDING_KV:
            del self.sending[request.request_id]
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def schedule(self, now_s: float) -> SchedulerOutput:
        """Class by class, most urgent first: the class's running requests, then its
        waiting ones, so a waiting realtime request gets budget and blocks before a running
        batch request does."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # The running requests not yet scheduled this step, most urgent class first and
        # admission order within one (a stable sort): the victims a preemption picks from.
        self.running.sort(key=lambda r: r.priority_class.rank)
        pending = list(self.running)
        for cls in _CLASSES_BY_URGENCY:
            budget = self._run_class(cls, pending, budget, out)
            budget = self._admit_class(cls, pending, budget, out, now_s)
        return out

    def _run_class(
        self, cls: PriorityClass, pending: list[Request], budget: int, out: SchedulerOutput
    ) -> int:
        """Schedule the class's running requests in admission order; when blocks run out,
        preempt the pending request last in preemption order (a less urgent class's first,
        possibly the request itself). Returns the budget left."""
        while pending and pending[0].priority_class is cls and budget > 0:
            request = pending[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new >= 1, "a running request always has a token to compute"
            while self.kv_cache.allocate_slots(request, num_new) is None:
                victim = max(pending, key=self._preemption_key)
                pending.remove(victim)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                pending.pop(0)
                out.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
        return budget

    def _admit_class(
        self, cls: PriorityClass, pending: list[Request], budget: int, out: SchedulerOutput,
        now_s: float,
    ) -> int:  # fmt: skip
        """Admit the class's waiting requests in the queue's order, unless this step had to
        preempt (memory is tight) or the seats are taken: then only a request that can
        preempt a less urgent class's running request gets in, by doing so (the victims
        are all pending: less urgent classes are scheduled after this one). A request that
        does not fit blocks the queue behind it. Returns the budget left."""
        making_room_for: Request | None = None  # the request whose victims are being preempted
        while self.waiting and budget > 0:
            request = self.waiting.peek()
            if request.priority_class is not cls:
                break
            # A request preempted this step never gets back in now: its victims would be
            # of a less urgent class, and those are preempted before it (pending only
            # shrinks), so it finds none while the step is tight, and breaks below.
            victims = [r for r in pending if cls.more_urgent_than(r.priority_class)]
            no_seat = len(self.running) + len(self.waiting_for_kv) >= self.config.max_num_seqs
            tight = bool(out.preempted) and making_room_for is not request
            if (tight or no_seat) and not victims:
                break
            making_room_for = request
            if no_seat:
                self._preempt_one(victims, pending, out)
                continue
            hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
            if request.wants_remote_kv:
                end_token = self._remote_end_token(request)
                if end_token > num_hit_tokens:
                    if self._reserve_remote(request, hits, num_hit_tokens, end_token, now_s):
                        out.reserved.append(request)
                    elif victims:
                        self._preempt_one(victims, pending, out)
                    else:
                        break
                    continue
                # It already holds every block a prefill worker could send: say so, and
                # compute the rest here like any other request.
                request.wants_remote_kv = False
                request.kv_range = KvBlockRange(num_hit_tokens, num_hit_tokens, ())
                out.reserved.append(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new, hits) is None:
                if not victims:
                    break  # head-of-line blocking keeps priority order
                self._preempt_one(victims, pending, out)
                continue
            self._admit(request, num_hit_tokens, now_s)
            if num_new == 0:  # a prefill-only request whose every block was cached
                self._start_sending(request, out)
                continue
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _preempt_one(
        self, victims: list[Request], pending: list[Request], out: SchedulerOutput
    ) -> None:
        """Preempt the first of ``victims`` (pending requests of less urgent classes) in
        preemption order."""
        victim = max(victims, key=self._preemption_key)
        pending.remove(victim)
        self._preempt(victim, out)

    def _preemption_key(self, request: Request) -> tuple[int, float, tuple[int, float, str]]:
        """The largest is preempted first: the least urgent class, then the tenant served
        most, then its lowest priority, latest request (so one tenant's burst is not paid
        for by another)."""
        return (
            request.priority_class.rank,
            self.waiting.served_tokens(request.tenant),
            request.sort_key(),
        )

    def _admit(self, request: Request, num_hit_tokens: int, now_s: float) -> None:
        self.waiting.pop()
        self.num_admitted += 1
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        if request.first_scheduled_time_s is None:
            request.first_scheduled_time_s = now_s
        request.status = RequestStatus.RUNNING

    def _remote_end_token(self, request: Request) -> int:
        """The prompt's full blocks short of its last token: what a prefill worker can
        send (the last token is computed here, for its logits, as after a cache hit)."""
        block_size = self.kv_cache.block_size
        return (request.num_prompt_tokens - 1) // block_size * block_size

    def _reserve_remote(
        self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int,
        end_token: int, now_s: float,
    ) -> bool:  # fmt: skip
        if self.kv_cache.allocate_slots(request, end_token - num_hit_tokens, hits) is None:
            return False
        self._admit(request, num_hit_tokens, now_s)
        block_size = self.kv_cache.block_size
        block_ids = self.kv_cache.block_ids(request.request_id)
        request.kv_range = KvBlockRange(
            num_hit_tokens,
            end_token,
            tuple(block_ids[num_hit_tokens // block_size : end_token // block_size]),
        )
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_kv[request.request_id] = request
        return True

    def remote_kv_landed(self, request: Request) -> None:
        """The reserved blocks hold the prefill worker's KV: cache them and run."""
        assert request.kv_range is not None
        del self.waiting_for_kv[request.request_id]
        end_token = request.kv_range.end_token
        request.num_computed_tokens = end_token
        request.num_remote_tokens = request.kv_range.num_tokens
        self.kv_cache.commit(request, end_token)
        self._resume(request)

    def remote_kv_failed(self, request: Request) -> None:
        """No KV will land: compute the reserved part here, overwriting the blocks (which
        were never cached, so nothing read them)."""
        del self.waiting_for_kv[request.request_id]
        self._resume(request)

    def _resume(self, request: Request) -> None:
        request.wants_remote_kv = False
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _start_sending(self, request: Request, out: SchedulerOutput) -> None:
        assert request.send_from_token is not None
        block_size = self.kv_cache.block_size
        block_ids = self.kv_cache.block_ids(request.request_id)
        first, end = request.send_from_token, request.num_tokens
        request.kv_range = KvBlockRange(
            first, end, tuple(block_ids[first // block_size : end // block_size])
        )
        request.status = RequestStatus.SENDING_KV
        self.sending[request.request_id] = request
        out.kv_ready.append(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(
            request,
            request.num_computed_tokens,
            num_new,
            self.kv_cache.block_ids(request.request_id),
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.waiting.push(request)
        self.preemptions_by_class[request.priority_class] += 1
        out.preempted.append(request)

    def update_from_output(self, output: SchedulerOutput) -> None:
        """Account the tokens a step computed, once it succeeded: their full blocks enter
        the prefix cache now, and a prefill-only request that is done starts sending.
        (Sampled tokens are appended by the engine.)"""
        for s in output.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            self.waiting.charge(request, s.num_new_tokens)
            self.kv_cache.commit(request, request.num_computed_tokens)
            if request.is_prefill_only and request.num_computed_tokens == request.num_tokens:
                self.running.remove(request)
                self._start_sending(request, output)
