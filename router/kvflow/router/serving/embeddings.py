"""Embeddings from a pool's embedding workers (`kvflow worker --task embed`): the one call
the /v1/embeddings endpoint makes, and any other router module that needs vectors.

`embedder_info` says what the pool's embedding model allows (400 for a pool that
generates, 503 while none of its workers is up); `embed` sends one request's inputs to
the least loaded of them as one batch, and tries another worker when one is down or full.
Neither authenticates nor meters: the caller does (api/embeddings.py for clients).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.errors import (
    ApiError,
    invalid_request,
    no_worker_available,
    worker_failed,
)
from kvflow.router.routing.types import WorkerId
from kvflow.router.workers.errors import (
    RequestRejectedError,
    WorkerBusyError,
    WorkerDownError,
    WorkerError,
)
from kvflow.router.workers.pool import WorkerPool

# Workers tried for one request before it fails (down or full ones; an invalid request is
# refused by the first, since every worker of a pool would refuse it alike).
MAX_ATTEMPTS = 3

EmbeddingInput = str | Sequence[int]


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: list[list[float]]  # one per input, unit length
    num_tokens: tuple[int, ...]  # per input
    worker_id: str

    @property
    def prompt_tokens(self) -> int:
        return sum(self.num_tokens)


def _embedders(pool: WorkerPool, model: str) -> list[tuple[int, WorkerId, pb.WorkerInfo]]:
    """The routable workers embedding ``model``, least loaded first; a worker whose circuit
    breaker admits nothing now is left out, as routing leaves it out of completions."""
    found = []
    now_s = time.monotonic()
    for view in pool.views():
        info = pool.info_of(view.worker_id)
        is_embedder = info is not None and info.task == pb.TASK_EMBED
        breaker = pool.book.breaker(view.worker_id)
        is_admitting = breaker is None or breaker.admits(now_s)
        if view.is_healthy and view.model == model and is_embedder and is_admitting:
            assert info is not None
            found.append((view.queue_depth, view.worker_id, info))
    return sorted(found, key=lambda x: (x[0], x[1]))


def refuse_unless_generating(info: pb.WorkerInfo, model: str) -> None:
    """400 for a completion sent to a model whose workers embed (they cannot generate)."""
    if info.task == pb.TASK_EMBED:
        raise invalid_request(
            f"The model '{model}' makes embeddings and does not generate text; send it to "
            "/v1/embeddings, or ask for a model that generates.",
            param="model",
            code="model_not_generating",
        )


def embedder_info(pool: WorkerPool, model: str, pool_name: str) -> pb.EmbeddingInfo:
    """The embedding model's dimensions and limits; 400 when ``model``'s workers generate."""
    info = pool.model_info(model)
    if info is not None and info.task != pb.TASK_EMBED:
        raise invalid_request(
            f"The model '{model}' (pool '{pool_name}') generates text and does not make "
            "embeddings; send it to /v1/chat/completions, or ask /v1/embeddings for an "
            "embedding model (a pool of `kvflow worker --task embed`).",
            param="model",
            code="model_not_embedding",
        )
    embedders = _embedders(pool, model)
    if not embedders:
        raise no_worker_available(
            f"No healthy embedding worker in pool '{pool_name}' serves '{model}' right now "
            f"({pool.num_healthy()} of {len(pool)} workers healthy); retry shortly."
        )
    return embedders[0][2].embedding


async def embed(
    pool: WorkerPool,
    model: str,
    inputs: Sequence[EmbeddingInput],
    *,
    dimensions: int = 0,
    timeout_s: float,
    request_id: str | None = None,
    context: pb.RequestContext | None = None,
) -> EmbeddingResult:
    """One vector per input from the least loaded embedding worker of ``model``
    (``dimensions`` 0: the model's own). Raises ApiError: 400 for input the worker refuses
    (too long, ids outside its vocabulary), 503 when no worker could take it, 502 when the
    workers failed."""
    request = pb.EmbedRequest(
        request_id=request_id or uuid.uuid4().hex, dimensions=dimensions, context=context
    )
    for item in inputs:
        if isinstance(item, str):
            request.inputs.add(text=item)
        else:
            request.inputs.add(token_ids=pb.TokenIds(ids=item))
    tried: set[WorkerId] = set()
    last: WorkerError | None = None
    retry_after_s: float | None = None
    for _ in range(MAX_ATTEMPTS):
        candidates = [w for _, w, _ in _embedders(pool, model) if w not in tried]
        if not candidates:
            break
        worker_id = candidates[0]
        tried.add(worker_id)
        try:
            with pool.request_open(worker_id):
                response = await pool.client(worker_id).embed(request, timeout_s)
        except RequestRejectedError as exc:
            raise invalid_request(_said(exc)) from exc
        except WorkerBusyError as exc:
            pool.refused_busy(worker_id, exc.retry_after_s)
            last, retry_after_s = exc, exc.retry_after_s
            continue
        except WorkerDownError as exc:
            pool.mark_failed(worker_id, exc.detail)
            last = exc
            continue
        except WorkerError as exc:
            raise worker_failed(f"The embedding worker failed ({exc.detail}).") from exc
        return EmbeddingResult(
            [list(e.values) for e in response.embeddings],
            tuple(e.num_tokens for e in response.embeddings),
            worker_id,
        )
    raise _no_worker(model, last, retry_after_s)


def _said(exc: WorkerError) -> str:
    """What the worker said, without the status name gRPC prefixes."""
    return exc.detail.removeprefix("INVALID_ARGUMENT: ")


def _no_worker(model: str, last: WorkerError | None, retry_after_s: float | None) -> ApiError:
    why = "none is up" if last is None else f"the last said: {last.detail}"
    return no_worker_available(
        f"No embedding worker for '{model}' could take the request ({why}); retry shortly.",
        retry_after_s=retry_after_s or 1.0,
    )
