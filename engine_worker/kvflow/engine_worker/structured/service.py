"""The worker's structured-output support: a request's ``StructuredOutput`` -> its processor.

The vocabulary is read from the model files on the first constrained request (a GGUF's
49,152 tokens take ~1-4 s on this CPU, a tokenizer.json ~0.5 s), so workers that never
see one start as fast as before. Everything here runs in a worker thread of the gRPC
handler (``asyncio.to_thread``), never on the engine thread: compiling a large grammar
can take 100 ms and more, and the batch must not wait for it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.structured.grammar import (
    DEFAULT_CACHE_MIB,
    GrammarCompiler,
    GrammarSpec,
)
from kvflow.engine_worker.structured.processor import GrammarLogitsProcessor
from kvflow.engine_worker.structured.vocabulary import load_vocabulary
from kvflow.proto import worker_pb2 as pb


def spec_from_proto(message: pb.StructuredOutput) -> GrammarSpec:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError(
            "structured_output is set but names no format: set one of json_schema, "
            "json_object, regex, lark, ebnf"
        )
    if kind == "json_object":
        return GrammarSpec("json_object")
    source = getattr(message, kind)
    if not source:
        raise InvalidRequestError(f"structured_output.{kind} is empty")
    return GrammarSpec(kind, source)


class StructuredOutputs:
    def __init__(
        self,
        model_path: str | Path | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_bytes: int = DEFAULT_CACHE_MIB * 1024 * 1024,
    ) -> None:
        """``cache_bytes``: memory for compiled formats (grammar.py, entry_bytes)."""
        self._cache_bytes = cache_bytes
        self._model_path = model_path
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    vocab = load_vocabulary(self._model_path, self._eos_token_ids)
                except ModelLoadError as err:
                    raise InvalidRequestError(
                        f"this worker cannot constrain output: {err}"
                    ) from err
                self._compiler = GrammarCompiler(
                    vocab, self._vocab_size, cache_bytes=self._cache_bytes
                )
            return self._compiler

    def processor(self, message: pb.StructuredOutput) -> GrammarLogitsProcessor:
        """A fresh processor for one request; raises InvalidRequestError naming what the
        compiler rejected. Blocking: call it from a thread."""
        return GrammarLogitsProcessor.compile(self.compiler(), spec_from_proto(message))
