"""Carry out one attempt of an execution plan: open the workers' calls, feed the choice
stream, and turn a worker's failure into what it means for the request.

A failure before the client saw anything (or any failure of a buffered choice) raises
AttemptFailedError naming the workers to exclude: the caller asks placement for a new plan. A
refused request is a 400 wherever it runs; a failure after the client saw text is a 502
event in the stream.
"""

from __future__ import annotations

from kvflow.router.protocol.errors import ApiError, invalid_request, worker_failed
from kvflow.router.routing.placement import Colocated, ExecutionPlan
from kvflow.router.routing.types import WorkerId
from kvflow.router.serving.choice_stream import ChoiceStream
from kvflow.router.workers.errors import RequestRejectedError, WorkerDownError, WorkerError
from kvflow.router.workers.pool import WorkerPool
from kvflow.router.workers.records import GenerateInput


class AttemptFailedError(Exception):
    """This attempt failed before the client saw anything: exclude ``worker_ids``, re-plan."""

    def __init__(self, why: str, worker_ids: frozenset[WorkerId]) -> None:
        super().__init__(why)
        self.worker_ids = worker_ids


class PlanExecutor:
    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    async def run(
        self, plan: ExecutionPlan, request: GenerateInput, choice: ChoiceStream, *,
        is_buffered: bool,
    ) -> None:  # fmt: skip
        """Run ``plan`` to the end of the choice. Raises AttemptFailedError or ApiError."""
        assert isinstance(plan, Colocated)
        await self._run_colocated(plan, request, choice, is_buffered)

    async def _run_colocated(
        self, plan: Colocated, request: GenerateInput, choice: ChoiceStream, is_buffered: bool
    ) -> None:
        worker_id = plan.stream_worker
        stream = self._pool.client(worker_id).generate(request)
        try:
            with self._pool.request_open(worker_id):
                await choice.run(stream)
        except WorkerError as exc:
            raise self.stream_failed(exc, choice, is_buffered) from exc
        finally:
            stream.cancel()  # no-op when finished; aborts the worker's request otherwise

    def stream_failed(
        self, exc: WorkerError, choice: ChoiceStream, is_buffered: bool
    ) -> ApiError | AttemptFailedError:
        """What the failure of the stream the client reads means for the request."""
        if choice.has_output and not is_buffered:
            return worker_failed(f"The worker failed mid-stream ({exc.detail})")
        if isinstance(exc, RequestRejectedError):
            return invalid_request(f"The worker refused the request: {exc.detail}")
        if isinstance(exc, WorkerDownError):
            self._pool.mark_failed(WorkerId(exc.worker_id), exc.detail)
        return AttemptFailedError(str(exc), frozenset({WorkerId(exc.worker_id)}))
