"""Carry out one attempt of an execution plan: open the workers' calls, feed the choice
stream, and turn a worker's failure into what it means for the request.

A failure of the stream the client reads, before the client saw anything (or any failure
of a buffered choice), raises AttemptFailedError naming the workers to exclude: the caller
asks placement for a new plan. A refused request is a 400 wherever it runs; a failure after
the client saw text is a 502 event in the stream.

Every stream the client reads has a first-token and a token-stall deadline
(workers/deadlines.py). Missing one cancels the call (the worker aborts the request and
frees its blocks) and opens the worker's circuit (kvflow.router.breaker), whatever its
Health says; before the client saw text the request fails over, after it the stream ends
with a 504 event. Every call's verdict feeds its worker's circuit breaker
(`WorkerPool.request_open`).

A disaggregated plan (docs/router.md, "Disaggregated serving"):

1. Generate on the decode worker with `remote_prefill`; its first message is a
   KvReservation, awaited at most transfer_timeout_s (else: re-plan without it).
2. If the reservation covers any tokens, Prefill on the prefill worker (deadline
   transfer_timeout_s) runs beside the decode stream, which the client reads as usual.
3. A failed Prefill -> CancelKvTransfer on the decode worker, which then prefills locally:
   the request still succeeds. A decode stream that fails -> the Prefill call is cancelled
   (the prefill worker frees its blocks) and the attempt fails as any other. Leaving early
   (client gone) cancels both calls, which aborts and frees on both workers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from kvflow.router.breaker.machine import Outcome
from kvflow.router.metrics import RouterMetrics
from kvflow.router.protocol.errors import ApiError, invalid_request, worker_failed
from kvflow.router.routing.placement import (
    Colocated,
    Disaggregated,
    DisaggregationConfig,
    ExecutionPlan,
)
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.choice_stream import ChoiceStream
from kvflow.router.workers.client import WorkerClient
from kvflow.router.workers.deadlines import StreamDeadlines
from kvflow.router.workers.errors import (
    RequestRejectedError,
    WorkerBusyError,
    WorkerDownError,
    WorkerError,
    WorkerStalledError,
    WorkerTimeoutError,
    breaker_outcome,
)
from kvflow.router.workers.pool import WorkerPool
from kvflow.router.workers.records import GenerateInput, KvReservation, PrefillInput

log = logging.getLogger("kvflow.router.serving")

# CancelKvTransfer is a small call to a worker that is streaming to us; 2 s is generous.
CANCEL_TRANSFER_TIMEOUT_S = 2.0
# The decode worker streams once the blocks have landed, while the PrefillResponse is
# still on its way: a 1-token answer can finish first. Wait this long for it (for metrics)
# before cancelling; a prefill that takes longer was given up on by the decode worker.
PREFILL_RESULT_GRACE_S = 1.0


def worker_timed_out(message: str) -> ApiError:
    """A worker stopped sending tokens after the client saw some: the stream's error event."""
    return ApiError(504, message, type="server_error", code="worker_timeout")


class AttemptFailedError(Exception):
    """This attempt failed before the client saw anything: exclude ``worker_ids``, re-plan.
    ``retry_after_s``: a busy worker's own estimate of when it takes requests again;
    ``outcome``: what the failure says of the worker (None: nothing, e.g. busy)."""

    def __init__(
        self,
        why: str,
        worker_ids: frozenset[WorkerId],
        retry_after_s: float | None = None,
        outcome: Outcome | None = None,
    ) -> None:
        super().__init__(why)
        self.worker_ids = worker_ids
        self.retry_after_s = retry_after_s
        self.outcome = outcome


class StreamBrokenError(Exception):
    """The worker failed after the client saw text: the choice ends with ``error``;
    ``outcome`` is what that says of the worker (for the pool's circuit)."""

    def __init__(self, error: ApiError, outcome: Outcome | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


def prefill_failure_kind(exc: WorkerError) -> str:
    """The `kvflow_router_pd_failures_total` kind of a failed Prefill call."""
    if isinstance(exc, RequestRejectedError):
        return "prefill_rejected"
    if isinstance(exc, WorkerDownError):
        return "prefill_unavailable"
    if isinstance(exc, WorkerTimeoutError):
        return "prefill_timeout"
    return "prefill_failed"


class PlanExecutor:
    def __init__(
        self,
        pool: WorkerPool,
        metrics: RouterMetrics,
        config: DisaggregationConfig,
        deadlines: StreamDeadlines | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._config = config
        self.deadlines = deadlines or StreamDeadlines()

    async def run(
        self, plan: ExecutionPlan, request: GenerateInput, choice: ChoiceStream, *,
        is_buffered: bool,
    ) -> None:  # fmt: skip
        """Run ``plan`` to the end of the choice. Raises AttemptFailedError,
        StreamBrokenError or ApiError."""
        try:
            if isinstance(plan, Colocated):
                await self._run_colocated(plan, request, choice)
            else:
                await self._run_disaggregated(plan, request, choice)
        except WorkerError as exc:
            failure = self._stream_failed(exc, choice, is_buffered)
            if isinstance(failure, ApiError) and choice.has_output and not is_buffered:
                raise StreamBrokenError(failure, breaker_outcome(exc)) from exc
            raise failure from exc

    async def _run_colocated(
        self, plan: Colocated, request: GenerateInput, choice: ChoiceStream
    ) -> None:
        worker_id = plan.stream_worker
        stream = self._pool.client(worker_id).generate(request, self.deadlines)
        try:
            with self._pool.request_open(worker_id):
                await choice.run(stream)
        finally:
            stream.cancel()  # no-op when finished; aborts the worker's request otherwise

    async def _run_disaggregated(
        self, plan: Disaggregated, request: GenerateInput, choice: ChoiceStream
    ) -> None:
        timeout_s = self._config.transfer_timeout_s
        decode_id = plan.decode.worker_id
        decode = self._pool.client(decode_id)
        prefill_client = self._pool.client(plan.prefill.worker_id)  # now: the pool may change
        stream = decode.generate(replace(request, remote_prefill_timeout_s=timeout_s),
                                 self.deadlines)  # fmt: skip
        prefill: asyncio.Task[None] | None = None
        outcomes = self._metrics.pd_transfers
        try:
            with self._pool.request_open(decode_id) as attempt:
                try:
                    first = await stream.next_within(timeout_s)
                except WorkerTimeoutError as exc:
                    self._metrics.pd_failures.labels("reservation_timeout").inc()
                    attempt.outcome = Outcome.TIMEOUT
                    raise AttemptFailedError(str(exc), frozenset({decode_id}),
                                             outcome=Outcome.TIMEOUT) from exc  # fmt: skip
                if not isinstance(first, KvReservation):  # prefilling itself after all
                    outcomes.labels("not_reserved").inc()
                    await choice.run(stream, first)
                    return
                if first.num_tokens > 0:
                    prefill = asyncio.create_task(
                        self._prefill(prefill_client, decode, request, first)
                    )
                else:
                    outcomes.labels("nothing_to_send").inc()
                await choice.run(stream)
                if prefill is not None:
                    await asyncio.wait({prefill}, timeout=PREFILL_RESULT_GRACE_S)
                    if not prefill.done():
                        log.warning("%s: the decode worker finished without the prefill worker's "
                                    "blocks (it gave up waiting)", request.request_id)  # fmt: skip
                        self._metrics.pd_failures.labels("prefill_timeout").inc()
                        outcomes.labels("fallback").inc()
        except WorkerError:
            if not choice.has_output:
                self._metrics.pd_failures.labels("decode_failed").inc()
            raise
        finally:
            if prefill is not None and not prefill.done():
                prefill.cancel()  # cancels the Prefill call: the prefill worker frees its blocks
                await asyncio.gather(prefill, return_exceptions=True)
            stream.cancel()

    async def _prefill(
        self,
        client: WorkerClient,
        decode: WorkerClient,
        request: GenerateInput,
        reservation: KvReservation,
    ) -> None:
        """The prefill half; if it fails, the decode worker is told to prefill locally."""
        job = PrefillInput(request.request_id, request.prompt_token_ids, request.context)
        metrics = self._metrics
        try:
            with self._pool.request_open(WorkerId(client.address)):
                result = await client.prefill(job, reservation, self._config.transfer_timeout_s)
        except WorkerError as exc:
            metrics.pd_failures.labels(prefill_failure_kind(exc)).inc()
            if isinstance(exc, WorkerBusyError):
                metrics.worker_rejections.labels(exc.worker_id).inc()
                self._pool.refused_busy(WorkerId(exc.worker_id), exc.retry_after_s)
            metrics.pd_transfers.labels("fallback").inc()
            # A rejection is a configuration bug (kv layout, handoff version): say so louder.
            level = logging.ERROR if isinstance(exc, RequestRejectedError) else logging.WARNING
            log.log(level, "%s: prefill failed (%s); %s prefills locally",
                    request.request_id, exc, decode.address)  # fmt: skip
            try:
                await decode.cancel_kv_transfer(request.request_id, CANCEL_TRANSFER_TIMEOUT_S)
            except WorkerError as cancel_exc:  # the decode stream will fail and say so
                log.warning("%s: CancelKvTransfer failed: %s", request.request_id, cancel_exc)
            return
        metrics.pd_transfers.labels("sent").inc()
        metrics.pd_transfer_tokens.inc(reservation.num_tokens)
        metrics.pd_transfer_bytes.inc(result.num_sent_bytes)
        metrics.pd_transfer_s.observe(result.transfer_s)
        metrics.pd_prefill_s.observe(result.prefill_s)

    def _stream_failed(
        self, exc: WorkerError, choice: ChoiceStream, is_buffered: bool
    ) -> ApiError | AttemptFailedError:
        """What the failure of the stream the client reads means for the request."""
        is_stalled = isinstance(exc, WorkerStalledError)
        if isinstance(exc, WorkerStalledError):  # (its circuit opened: request_open)
            self._metrics.deadline_misses.labels(exc.miss.kind.value).inc()
        if isinstance(exc, WorkerBusyError):
            self._metrics.worker_rejections.labels(exc.worker_id).inc()
            self._pool.refused_busy(WorkerId(exc.worker_id), exc.retry_after_s)
        if choice.has_output and not is_buffered:
            if is_stalled:
                return worker_timed_out(
                    f"The worker stopped mid-stream ({exc.detail}); the request was aborted "
                    "there. Retry it."
                )
            return worker_failed(f"The worker failed mid-stream ({exc.detail})")
        if isinstance(exc, RequestRejectedError):
            return invalid_request(f"The worker refused the request: {exc.detail}")
        if isinstance(exc, WorkerDownError):
            self._pool.mark_failed(WorkerId(exc.worker_id), exc.detail)
        retry_after_s = exc.retry_after_s if isinstance(exc, WorkerBusyError) else None
        return AttemptFailedError(str(exc), frozenset({WorkerId(exc.worker_id)}), retry_after_s,
                                  breaker_outcome(exc))  # fmt: skip
