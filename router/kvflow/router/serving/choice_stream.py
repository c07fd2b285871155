"""One attempt at one choice: the worker's token chunks -> text deltas, then usage.

It emits through a callable: the request's merged stream, or a buffer that a retry drops.
A stop string ends the choice early: the worker's request is aborted and its final message
(the usage) awaited briefly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvflow.router.protocol.responses import ChoiceDelta, UsageCounts
from kvflow.router.serving.decoder import ChoiceDecoder
from kvflow.router.serving.types import ChoiceSpec, ChoiceUsage
from kvflow.router.text.tokenizer import TextTokenizer
from kvflow.router.workers.client import WorkerStream
from kvflow.router.workers.errors import WorkerCallError
from kvflow.router.workers.records import TokenChunk, WorkerUsage

# After a stop string, how long to wait for the worker's final message (for usage).
ABORT_DRAIN_TIMEOUT_S = 2.0

Emit = Callable[[ChoiceDelta | ChoiceUsage], None]


class ChoiceStream:
    def __init__(
        self,
        spec: ChoiceSpec,
        tokenizer: TextTokenizer,
        emit: Emit,
        on_first_message: Callable[[], None],
        on_token_gap: Callable[[float], None] | None = None,
    ) -> None:
        """``on_token_gap``: the seconds between this choice's successive token messages
        (the gateway's inter-token latency, as its clients see it)."""
        self._spec = spec
        self._decoder = ChoiceDecoder(
            spec.index,
            tokenizer,
            spec.sampling.stop_strings,
            with_logprobs=spec.sampling.logprobs,
            num_top_logprobs=spec.sampling.top_logprobs,
            num_prompt_tokens=len(spec.prompt_token_ids),
            include_stop_str=spec.sampling.include_stop_str_in_output,
            skip_special_tokens=spec.sampling.skip_special_tokens,
        )
        self._emit = emit
        self._on_first_message = on_first_message
        self._on_token_gap = on_token_gap
        self._last_message_s = 0.0
        self.has_output = False  # a chunk arrived: a retry is no longer invisible

    async def run(self, stream: WorkerStream, first: TokenChunk | None = None) -> None:
        """Read ``stream`` (after ``first``, if the caller read it) until the choice is
        complete. Raises WorkerError from the stream, also when the worker aborted it."""
        chunk = first if first is not None else await self._next(stream)
        while not await self._feed(stream, chunk):
            chunk = await self._next(stream)

    async def _next(self, stream: WorkerStream) -> TokenChunk:
        item = await stream.next()
        if not isinstance(item, TokenChunk):
            raise WorkerCallError(stream.worker_id, "a KV reservation in the middle of the stream")
        return item

    async def _feed(self, stream: WorkerStream, chunk: TokenChunk) -> bool:
        """Emit what ``chunk`` adds; True once the choice is complete."""
        if chunk.finish_reason == "abort" and not self.has_output and not chunk.token_ids:
            # Aborted before its first token (a failed step, a lost tensor-parallel rank, a
            # drain): the client saw nothing, so another worker may take it.
            raise WorkerCallError(stream.worker_id, "the worker aborted the request")
        now_s = time.perf_counter()
        if not self.has_output:
            self.has_output = True
            self._on_first_message()
        elif self._on_token_gap is not None and chunk.token_ids:
            self._on_token_gap(now_s - self._last_message_s)
        if chunk.token_ids:
            self._last_message_s = now_s
        emit = self._emit
        delta = self._decoder.feed(chunk.token_ids, chunk.logprobs)
        if self._decoder.is_stopped:
            if delta is not None:
                emit(delta)
            emit(self._decoder.finish("stop"))
            emit(self._usage(await stream.abort_and_drain(ABORT_DRAIN_TIMEOUT_S)))
            return True
        if chunk.finish_reason is None:
            if delta is not None:
                emit(delta)
            return False
        if chunk.finish_reason == "abort":
            # A worker fault like any other (the executor decides): a stream the client
            # reads ends with an error event, a buffered choice starts over elsewhere.
            raise WorkerCallError(stream.worker_id, "the worker aborted the request")
        if delta is not None:
            emit(delta)
        emit(self._decoder.finish(chunk.finish_reason))
        emit(self._usage(chunk.usage))
        return True

    def _usage(self, final: WorkerUsage | None) -> ChoiceUsage:
        spec = self._spec
        if final is None:  # the worker's final message never came: estimate
            usage = UsageCounts(len(spec.prompt_token_ids), self._decoder.num_tokens, 0)
        else:
            usage = UsageCounts(final.prompt_tokens, final.completion_tokens, final.cached_tokens)
        return ChoiceUsage(spec.index, spec.prompt_index, usage)
