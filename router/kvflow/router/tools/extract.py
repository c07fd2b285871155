"""Which extractor a chat request's choices get, and the stream wrapper that applies it."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import TypeVar

from kvflow.router.protocol.requests import ChatRequest
from kvflow.router.protocol.responses import ChoiceDelta
from kvflow.router.tools.parsers import family_of_template
from kvflow.router.tools.stream import (
    ArrayCallStream,
    HermesStream,
    Llama3JsonStream,
    NamedCallStream,
    ToolCallExtractor,
)

T = TypeVar("T")
ExtractorFactory = Callable[[], ToolCallExtractor]


def extractor_factory(request: ChatRequest, template_source: str | None) -> ExtractorFactory | None:
    """None when the output cannot hold calls: no tools, ``tool_choice: none``, or a
    ``response_format`` that constrains the text to something else."""
    choice = request.tool_choice
    if not request.tools or choice.mode == "none":
        return None
    if choice.mode == "named":
        name = choice.name
        assert name is not None
        return lambda: NamedCallStream(name)
    if choice.mode == "required":
        return ArrayCallStream
    if request.sampling.constraint is not None:
        return None
    if family_of_template(template_source) == "llama3_json":
        return Llama3JsonStream
    return HermesStream


async def with_tool_calls(
    stream: AsyncGenerator[T], factory: ExtractorFactory
) -> AsyncGenerator[T | ChoiceDelta]:
    """``stream`` with each choice's text deltas passed through its own extractor. Closing
    this closes ``stream`` (which cancels the workers' calls)."""
    extractors: dict[int, ToolCallExtractor] = {}
    try:
        async for item in stream:
            if not isinstance(item, ChoiceDelta):
                yield item
                continue
            extractor = extractors.get(item.index)
            if extractor is None:
                extractor = extractors[item.index] = factory()
            out = extractor.feed(item)
            if out is not None:
                yield out
    finally:
        await stream.aclose()
