"""The engine loop without I/O: admit, schedule, run, sample, stop, free.

The model is behind ``ModelRunner``: the torch runner computes real logits, the simulated
runner a timing model, a test a fixed rule. Everything else (limits, stop conditions,
block accounting, prefix caching) is this one code path for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.errors import DuplicateRequestError, InvalidRequestError
from kvflow.engine_worker.core.kv_cache_manager import KVCacheManager
from kvflow.engine_worker.core.queue_limits import DrainRateMeter, QueueStats, check_queue
from kvflow.engine_worker.core.request import FinishReason, KvBlockRange, Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import Scheduler, SchedulerOutput
from kvflow.proto.priority_class import PriorityClass


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # set when the request asked for logprobs
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


class ModelRunner(Protocol):
    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        """Compute every scheduled token, writing its K/V to the request's blocks, and
        sample the next token of each request whose step ``samples``. Keyed by request id."""
        ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (e.g. a seeded generator) once a request is done."""
        ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    scheduler: SchedulerConfig
    num_kv_blocks: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    hash_seed: bytes
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class Timings:
    queued_s: float
    ttft_s: float
    e2e_s: float
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request. The final one has ``finish_reason`` set.

    A matched EOS or stop token is not in ``new_tokens``: it ends the text, it is not part
    of it; it is reported as ``stop_token_id`` and counted in ``num_output_tokens``.
    """

    request_id: str
    new_tokens: list[SampledToken]
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_remote_tokens: int = 0
    timings: Timings | None = None
    # PD: set on a decode-side request's first output (the blocks it waits for; empty when
    # it needs none), and on a prefill-side request's output once the blocks are computed.
    kv_reserved: KvBlockRange | None = None
    kv_to_send: KvBlockRange | None = None
    # Set on a finished output: the class its metrics count under (the request is gone).
    priority_class: PriorityClass = PriorityClass.NORMAL


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.runner = runner
        self.clock = clock
        self.kv_cache = KVCacheManager(
            num_blocks=config.num_kv_blocks,
            block_size=config.scheduler.block_size,
            hash_seed=config.hash_seed,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.requests: dict[str, Request] = {}
        self.last_step_was_idle = False  # scheduled, reserved and sent nothing
        self._drain = DrainRateMeter()
        # When the last step ended with requests still waiting (None: it did not): the
        # queue has been backlogged since, so the next step's admissions measure capacity.
        self._backlogged_since_s: float | None = None
        # Replaced (never mutated) after every step and admission: other threads read it.
        self.queue_stats = QueueStats(max_waiting_requests=config.scheduler.max_waiting_requests)
        # A request can never grow past what the whole cache holds, or it would preempt
        # itself forever.
        self.max_len = min(
            config.scheduler.max_model_len, config.num_kv_blocks * config.scheduler.block_size
        )

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def has_schedulable_work(self) -> bool:
        """Whether ``step`` could make progress now; requests waiting on a KV transfer
        need an event (landed, failed, sent) first."""
        return self.scheduler.has_work

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        cache_salt: str = "",
        num_public_blocks: int = 0,
        priority: int = 0,
        tenant: str | None = None,
        wants_remote_kv: bool = False,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> Request:
        """Validate and queue a request; raises InvalidRequestError saying what is wrong,
        QueueFullError (holding nothing) when the waiting queue is at its bound.

        ``tenant`` keys fair sharing (None: the cache salt); ``priority_class`` ranks
        above it (scheduler.py). ``wants_remote_kv`` (PD,
        decode side): reserve blocks for the prompt part this worker lacks and wait for a
        prefill worker to send them; the first output says which."""
        self._validate(request_id, prompt_token_ids, num_public_blocks)
        sampling.validate(self.config.vocab_size)
        self._check_queue(priority_class)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            arrival_time_s=self.clock(),
            cache_salt=cache_salt,
            num_public_blocks=num_public_blocks,
            priority=priority,
            tenant=cache_salt if tenant is None else tenant,
            priority_class=priority_class,
            wants_remote_kv=wants_remote_kv,
        )
        self._queue(request)
        return request

    def add_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        first_token: int,
        end_token: int,
        cache_salt: str = "",
        num_public_blocks: int = 0,
        priority: int = 0,
        tenant: str | None = None,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> Request:
        """PD, prefill side: compute the KV of prompt positions [0, end_token) (its own
        prefix cache counts) and, once done, hand blocks [first_token, end_token) out as
        ``kv_to_send``; they stay held until ``complete_kv_send``. Raises as add_request."""
        self._validate(request_id, prompt_token_ids, num_public_blocks)
        block_size = self.config.scheduler.block_size
        if not (
            0 <= first_token < end_token < len(prompt_token_ids)
            and first_token % block_size == 0
            and end_token % block_size == 0
        ):
            raise InvalidRequestError(
                f"cannot send prompt positions [{first_token}, {end_token}) of a "
                f"{len(prompt_token_ids)}-token prompt: both ends must be multiples of the "
                f"block size {block_size}, first < end, and end below the prompt length"
            )
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids[:end_token]),
            sampling=SamplingParams(),
            arrival_time_s=self.clock(),
            cache_salt=cache_salt,
            num_public_blocks=num_public_blocks,
            priority=priority,
            tenant=cache_salt if tenant is None else tenant,
            priority_class=priority_class,
            send_from_token=first_token,
        )
        self._check_queue(priority_class)
        self._queue(request)
        return request

    def _check_queue(self, priority_class: PriorityClass) -> None:
        check_queue(self.queue_stats, self.config.scheduler.max_queue_time_s, priority_class)

    def _queue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        self._publish_queue_stats()

    def _publish_queue_stats(self) -> None:
        self.queue_stats = QueueStats(
            num_waiting=self.scheduler.num_waiting,
            drain_rate_per_s=self._drain.rate_per_s,
            max_waiting_requests=self.config.scheduler.max_waiting_requests,
            num_waiting_by_rank=self.scheduler.waiting.num_waiting_by_rank,
        )

    def _validate(
        self, request_id: str, prompt_token_ids: Sequence[int], num_public_blocks: int
    ) -> None:
        if not request_id:
            raise InvalidRequestError("request_id must not be empty")
        if request_id in self.requests:
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: send at least one token")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"prompt token id {bad} is outside the vocabulary [0, {vocab})"
            )
        if len(prompt_token_ids) >= self.max_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but this worker's context holds "
                f"{self.max_len} including at least one output token; shorten the prompt"
            )
        if num_public_blocks < 0:
            raise InvalidRequestError(f"num_public_blocks must be >= 0, got {num_public_blocks}")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already done."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        self._publish_queue_stats()
        return self._finish(request, [])

    def remote_kv_landed(self, request_id: str) -> bool:
        """PD decode: the reserved blocks now hold the sent KV (the caller wrote them)."""
        request = self._waiting_for_kv(request_id)
        if request is None:
            return False
        self.scheduler.remote_kv_landed(request)
        return True

    def remote_kv_failed(self, request_id: str) -> bool:
        """PD decode: no KV will land; the request computes its prompt here instead."""
        request = self._waiting_for_kv(request_id)
        if request is None:
            return False
        self.scheduler.remote_kv_failed(request)
        return True

    def _waiting_for_kv(self, request_id: str) -> Request | None:
        return self.scheduler.waiting_for_kv.get(request_id)

    def complete_kv_send(self, request_id: str, *, is_sent: bool) -> RequestOutput | None:
        """PD prefill: the blocks were sent (or the send failed); free them and finish."""
        request = self.scheduler.sending.get(request_id)
        if request is None:
            return None
        reason = FinishReason.STOP if is_sent else FinishReason.ABORT
        self.scheduler.finish(request, reason)
        return self._finish(request, [])

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch. Returns an output for every request that sampled, and
        the PD handoffs the step made (blocks reserved, blocks ready to send)."""
        now_s = self.clock()
        num_admitted_before = self.scheduler.num_admitted
        output = self.scheduler.schedule(now_s)
        if self._backlogged_since_s is not None:
            self._drain.observe(self.scheduler.num_admitted - num_admitted_before,
                                now_s - self._backlogged_since_s, was_backlogged=True)  # fmt: skip
        self._backlogged_since_s = now_s if self.scheduler.waiting else None
        self._publish_queue_stats()
        self.last_step_was_idle = output.is_empty and not output.reserved and not output.kv_ready
        results = [RequestOutput(r.request_id, [], kv_reserved=r.kv_range) for r in output.reserved]
        if not output.is_empty:
            results += self._run(output)
        results += [RequestOutput(r.request_id, [], kv_to_send=r.kv_range) for r in output.kv_ready]
        return results

    def _run(self, output: SchedulerOutput) -> list[RequestOutput]:
        sampled = self.runner.execute(output)
        self.scheduler.update_from_output(output)
        now = self.clock()
        results: list[RequestOutput] = []
        for s in output.scheduled:
            if not s.samples:
                continue  # a prefill chunk that has not reached the end of the prompt
            request = s.request
            token = sampled[request.request_id]
            request.token_ids.append(token.token_id)
            if request.first_token_time_s is None:
                request.first_token_time_s = now
            reason = self._stop_reason(request, token.token_id)
            if reason is None:
                results.append(RequestOutput(request.request_id, [token]))
                continue
            self.scheduler.finish(request, reason)
            is_stop_token = request.stop_token_id is not None
            results.append(self._finish(request, [] if is_stop_token else [token]))
        return results

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        params = request.sampling
        is_stop_token = (not params.ignore_eos and token_id in self.config.eos_token_ids) or (
            token_id in params.stop_token_ids
        )
        # The sampler masks stop tokens before min_tokens; a runner that does not sample
        # from logits (the simulator) may still produce one, which then does not stop.
        if is_stop_token and request.num_output_tokens > params.min_tokens:
            request.stop_token_id = token_id
            return FinishReason.STOP
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, tokens: list[SampledToken]) -> RequestOutput:
        del self.requests[request.request_id]
        self.runner.release(request.request_id)
        now = self.clock()
        request.finished_time_s = now
        arrival = request.arrival_time_s
        first_scheduled = request.first_scheduled_time_s
        first_token = request.first_token_time_s
        assert request.finish_reason is not None
        return RequestOutput(
            request_id=request.request_id,
            new_tokens=tokens,
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_remote_tokens=request.num_remote_tokens,
            priority_class=request.priority_class,
            timings=Timings(
                queued_s=(first_scheduled if first_scheduled is not None else now) - arrival,
                ttft_s=(first_token if first_token is not None else now) - arrival,
                e2e_s=now - arrival,
                num_preemptions=request.num_preemptions,
            ),
        )
