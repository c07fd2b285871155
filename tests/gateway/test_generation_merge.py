"""A request's choices merge a batch per turn of the event loop (serving/generate.py,
``ITEMS_PER_LOOP_TURN``).

``asyncio.Queue.get`` returns without yielding while items wait, and a buffered response
consumes the merge without awaiting anything either, so without the batching thousands of
waiting deltas (1,024 choices that finished together) would be merged in one turn: /health
and every other request on the gateway would wait that long.
tests/gateway/test_request_limits_http.py times /health beside a request at the choice
limit over real HTTP, which guards the choices' start (``CHOICES_PER_LOOP_TURN``) but not
this: without it /health's slowest answer moved by milliseconds there. So this is a unit
test of the merge alone, counting the loop's turns: each choice's task is replaced by one
that queues all its deltas at once (the worst case), and a ticker task counts the turns it
gets while the merge drains them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvflow.router.protocol.responses import ChoiceDelta
from kvflow.router.serving import generate
from kvflow.router.serving.generate import GenerationService
from kvflow.router.serving.types import ChoiceUsage, RequestTrace

NUM_CHOICES = 64
DELTAS_PER_CHOICE = 200


async def _merge(service: GenerationService) -> tuple[int, int]:
    """(items merged, turns the ticker got while they were merged)."""

    async def finished_choice(
        caller: Any, spec: Any, trace: Any, queue: asyncio.Queue[object], buffered: bool
    ) -> None:
        for _ in range(DELTAS_PER_CHOICE):
            queue.put_nowait(ChoiceDelta(index=spec, text="x"))
        queue.put_nowait(generate._DONE)

    service._choice_task = finished_choice  # type: ignore[method-assign]
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    items = 0
    first_turn = None
    try:
        specs: Any = list(range(NUM_CHOICES))
        async for item in service.run(None, specs, RequestTrace(), buffered=True):  # type: ignore[arg-type]
            assert isinstance(item, ChoiceDelta | ChoiceUsage)
            if first_turn is None:
                first_turn = turns  # every choice has queued its deltas by now
            items += 1
    finally:
        tick.cancel()
    assert first_turn is not None
    return items, turns - first_turn


def test_waiting_deltas_are_merged_a_batch_per_turn_of_the_loop() -> None:
    # The merge reads none of the service's parts: each choice's task is replaced.
    service = GenerationService(*([None] * 7))  # type: ignore[arg-type]
    items, turns = asyncio.run(_merge(service))
    assert items == NUM_CHOICES * DELTAS_PER_CHOICE
    # One turn for every ITEMS_PER_LOOP_TURN items merged (the done markers count too);
    # merged in one turn, the ticker would get none.
    expected = (items + NUM_CHOICES) // generate.ITEMS_PER_LOOP_TURN
    assert turns >= expected - 2, (turns, expected)
