"""Ending requests on the engine thread: an abort, a request that failed inside the worker,
and every request at once after a failed step.

Each one cancels the request's KV transfer before the engine frees its blocks: a cancel
returns only once no transfer thread touches them, so no transfer writes or reads a block
that another request may own next. Split from ``engine_loop`` so that this order lives in
one place; the loop decides when a request ends and tells its stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.kv_handoff import KvHandoff
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent

log = logging.getLogger(__name__)


def abort(
    engine: Engine, kv: KvTransferAgent | None, handoff: KvHandoff | None, request_id: str
) -> RequestOutput | None:
    """Abort whichever request runs under this id; its final output, if it ran."""
    if kv is not None:
        kv.cancel(request_id)
    if handoff is not None:
        handoff.forget(request_id)
    return engine.abort_request(request_id)


def free_failed(
    engine: Engine, kv: KvTransferAgent | None, handoff: KvHandoff | None, request_id: str
) -> None:
    """Free what a failed request holds, each part even if freeing another raised."""
    cleanups: tuple[Callable[[], object], ...] = (
        lambda: kv.cancel(request_id) if kv is not None else None,
        lambda: handoff.forget(request_id) if handoff is not None else None,
        lambda: engine.abort_request(request_id),
    )
    for cleanup in cleanups:
        try:
            cleanup()
        except Exception:  # keep freeing what can be freed
            log.exception("request %s: cleaning up after its failure failed", request_id)


def abort_all(
    engine: Engine, kv: KvTransferAgent | None, handoff: KvHandoff | None = None
) -> list[RequestOutput]:
    """Abort every request (a step failed); the final outputs of those that ran."""
    if kv is not None:  # transfers stop touching the blocks before they are freed
        for request_id in list(engine.requests):
            kv.cancel(request_id)
    if handoff is not None:  # nor their sends and reservations' deadlines, kept forever
        for request_id in list(engine.requests):
            handoff.forget(request_id)
    outs = [engine.abort_request(rid) for rid in list(engine.requests)]
    return [o for o in outs if o is not None and o.finish_reason is FinishReason.ABORT]
