"""A choice's task always ends its request's wait (serving/generate.py, `_choice_task`).

`GenerationService.run` waits for a done marker or an error from every choice. A
CancelledError that is not the task's own (a gRPC call cancelled beneath it, which the
worker client should have turned into a WorkerError) must still put an error there, or the
request would wait forever; a real cancellation of the request must still cancel it. The
merge reads none of the service's parts: each choice's body is replaced.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kvflow.router.protocol.errors import ApiError
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.types import RequestTrace


def _service(run_choice: Any) -> GenerationService:
    service = GenerationService(*([None] * 7))  # type: ignore[arg-type]
    service._run_choice = run_choice  # type: ignore[method-assign]
    return service


async def _drain(service: GenerationService) -> list[object]:
    specs: Any = [SimpleNamespace(index=0)]  # the replaced body reads nothing else of it
    return [item async for item in service.run(None, specs, RequestTrace(), buffered=False)]  # type: ignore[arg-type]


def test_a_cancelled_error_not_the_tasks_own_ends_the_request_with_a_502() -> None:
    async def call_cancelled_beneath(*args: Any) -> None:
        raise asyncio.CancelledError  # as awaiting a gRPC call whose channel closed does

    async def scenario() -> None:
        with pytest.raises(ApiError) as info:
            async with asyncio.timeout(5):  # the old code waited here forever
                await _drain(_service(call_cancelled_beneath))
        assert info.value.status == 502

    asyncio.run(scenario())


def test_cancelling_the_request_still_cancels_its_choices() -> None:
    started = asyncio.Event()
    cancelled: list[bool] = []

    async def long_choice(*args: Any) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario() -> None:
        request = asyncio.create_task(_drain(_service(long_choice)))
        await started.wait()
        request.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await request

    asyncio.run(scenario())
    assert cancelled == [True]
