"""What a request cut short is charged (api/accounting.py, api/respond.py): the choices whose
final usage came keep it; the others are charged the tokens received from their workers,
and their prompts once prefilled. End to end: tests/gateway/test_usage_on_disconnect.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, cast

from kvflow.router.api.accounting import Accounting, unsettled_usage
from kvflow.router.api.respond import _count_received
from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.types import ChoiceUsage, RequestTrace

Item = ChoiceDelta | ChoiceUsage


def _accounting(*, first_token_s: float | None = 1.0) -> Accounting:
    """An accounting that is never finished: its usage needs no gateway."""
    trace = RequestTrace(first_token_s=first_token_s)
    nothing = cast(Any, None)
    return Accounting(gateway=nothing, tenant=nothing, lease=nothing, trace=trace)


def _delta(index: int, num_tokens: int, num_prompt_tokens: int = 7) -> ChoiceDelta:
    return ChoiceDelta(index, "x", num_prompt_tokens=num_prompt_tokens,
                       num_completion_tokens=num_tokens)  # fmt: skip


def test_unsettled_choices_are_charged_what_they_received() -> None:
    # Two prompts, n=2: prompt 0's choices are 0 and 1, prompt 1's 2 and 3.
    usage = unsettled_usage([7, 5], {0: 3, 1: 4, 2: 9}, {1}, settled_prompts={0},
                            is_prefilled=True, num_choices=4)  # fmt: skip
    # Choices 0 and 2 never settled; prompt 0 was already charged by choice 1's usage.
    assert usage == UsageCounts(prompt_tokens=5, completion_tokens=3 + 9)


def test_prompts_count_once_prefilled_only() -> None:
    # No first token: the worker may not have reached the prompt, and generated nothing.
    assert unsettled_usage([7], {}, set(), settled_prompts=set(),
                           is_prefilled=False) == UsageCounts()  # fmt: skip
    # One prompt: the request's first token says a worker prefilled it.
    assert unsettled_usage([7], {}, set(), settled_prompts=set(),
                           is_prefilled=True) == UsageCounts(prompt_tokens=7)  # fmt: skip


def test_of_several_prompts_only_those_a_worker_answered_count() -> None:
    """A client that leaves a 3-prompt request after the first prompt's tokens pays for
    that prompt, not for the two no worker had reached (each was charged before)."""
    assert unsettled_usage([7, 5, 9], {0: 2}, set(), settled_prompts=set(), is_prefilled=True,
                           num_choices=3) == UsageCounts(7, 2)  # fmt: skip
    # Received tokens count for a choice's prompt whether streamed or buffered (the trace).
    assert unsettled_usage([7, 5, 9], {0: 2, 2: 1}, set(), settled_prompts=set(),
                           is_prefilled=True, num_choices=3) == UsageCounts(16, 3)  # fmt: skip
    # n=2: choice 3 is prompt 1's.
    assert unsettled_usage([7, 5], {3: 4}, set(), settled_prompts=set(), is_prefilled=True,
                           num_choices=4) == UsageCounts(5, 4)  # fmt: skip
    # A choice that has received no token yet says nothing of its prompt.
    assert unsettled_usage([7, 5], {0: 0}, set(), settled_prompts=set(), is_prefilled=True,
                           num_choices=2) == UsageCounts()  # fmt: skip


def test_a_settled_request_is_charged_its_final_usage_only() -> None:
    accounting = _accounting()
    accounting.add(_delta(0, 3))
    accounting.add(ChoiceUsage(0, 0, UsageCounts(7, 4, 2)))
    accounting.charge_unsettled([7])
    assert accounting.own_usage == UsageCounts(7, 4, 2)


def test_a_request_cut_short_is_charged_prompt_and_received_tokens() -> None:
    accounting = _accounting()
    for num_tokens in (1, 2, 5):  # counts so far: the latest is the choice's
        accounting.add(_delta(0, num_tokens))
    accounting.add(_delta(1, 2))
    accounting.add(ChoiceUsage(1, 0, UsageCounts(7, 3, 0)))
    assert accounting.own_usage == UsageCounts(7, 3, 0)  # nothing estimated unasked
    accounting.charge_unsettled([7])
    assert accounting.own_usage == UsageCounts(7, 3 + 5, 0)
    accounting.charge_unsettled([7])  # idempotent
    assert accounting.own_usage == UsageCounts(7, 3 + 5, 0)


def test_a_replayed_answer_is_never_estimated() -> None:
    accounting = _accounting()
    accounting.is_replayed = True
    accounting.add(_delta(0, 5))
    accounting.charge_unsettled([7])
    assert accounting.own_usage == UsageCounts()


def test_items_received_but_not_sent_are_counted_then_the_stream_ends() -> None:
    async def run() -> None:
        queue: asyncio.Queue[Item] = asyncio.Queue()
        ended = asyncio.Event()

        async def stream() -> AsyncGenerator[Item]:  # like serving/generate.py's merge
            try:
                while True:
                    yield await queue.get()
            finally:
                ended.set()  # (there: the choices' worker calls are cancelled)

        items = stream()
        queue.put_nowait(_delta(0, 1))
        assert await anext(items) == _delta(0, 1)  # sent to the client, who then left
        for num_tokens in (2, 3, 4):
            queue.put_nowait(_delta(0, num_tokens))
        accounting = _accounting()
        await _count_received(items, accounting)
        assert ended.is_set()  # the first wait ended it, at once
        accounting.charge_unsettled([7])
        assert accounting.own_usage == UsageCounts(7, 4, 0)
        # A stream already over (the response ran to its end) adds nothing.
        await _count_received(items, accounting)
        assert accounting.own_usage == UsageCounts(7, 4, 0)

    asyncio.run(run())
