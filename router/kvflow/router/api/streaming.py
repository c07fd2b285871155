"""The SSE side of a completion: chunks in OpenAI's order, cleanup however it ends."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvflow.router.api.accounting import Accounting
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.responses import SSE_DONE, ChoiceDelta, ChunkWriter, sse_error
from kvflow.router.serving.types import ChoiceUsage


class ManagedStreamingResponse(StreamingResponse):
    """Runs ``on_close`` however the response ends, even if the body never started (a
    client gone before the first byte): the worker requests and the quota lease are freed."""

    def __init__(self, body: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str]) -> None:  # fmt: skip
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()

    def rewritten(
        self,
        rewrite: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]],
        headers: dict[str, str],
    ) -> ManagedStreamingResponse:
        """The same stream in another wire format (api/responses.py): ``rewrite`` of this
        body, with ``headers``; its end runs this one's cleanup, and this one is not sent."""
        body = self.body_iterator
        assert isinstance(body, AsyncIterator)
        return ManagedStreamingResponse(rewrite(body), self._on_close, headers)


async def sse_body(
    first: ChoiceDelta | ChoiceUsage,
    stream: AsyncGenerator[ChoiceDelta | ChoiceUsage],
    writer: ChunkWriter,
    accounting: Accounting,
    num_choices: int,
    is_chat: bool,
    echo: list[str] | None,
    n: int,
) -> AsyncGenerator[bytes]:
    if is_chat:
        for index in range(num_choices):
            yield writer.role(index)
    elif echo is not None:
        for index in range(num_choices):
            yield writer.delta(ChoiceDelta(index, echo[index // n]))
    item: ChoiceDelta | ChoiceUsage | None = first
    try:
        while item is not None:
            accounting.add(item)
            if isinstance(item, ChoiceDelta):
                yield writer.delta(item)
            item = await anext(stream, None)
    except ApiError as exc:
        # Headers are gone: the failure travels as an event the openai client raises on.
        yield sse_error(exc.body())
        return
    if writer.include_usage:
        yield writer.usage(accounting.usage)
    yield SSE_DONE
