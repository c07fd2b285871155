"""An embedding worker's requests: checked, queued, and computed one batch at a time.

Each request's inputs go through the model as one batch (embed/model.py) on the single
compute thread, so the event loop keeps answering Health and Load while a batch runs.
Requests beyond `max_waiting_requests` in flight are refused at once (the caller tries
another worker), never queued without bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvflow.engine_worker.core.errors import InvalidRequestError, QueueFullError
from kvflow.engine_worker.embed.model import StaticEmbedder

# An input is a text, or token ids of the model's own tokenizer.
EmbedInput = str | Sequence[int]

# OpenAI's limits for its embedding models: 2048 inputs per request, 8192 tokens per input.
DEFAULT_MAX_INPUTS = 2048
DEFAULT_MAX_INPUT_TOKENS = 8192
DEFAULT_MAX_WAITING_REQUESTS = 256
# A full queue's hint to callers (gRFC A6 pushback): a batch is milliseconds on a CPU.
RETRY_AFTER_S = 0.1


@dataclass(frozen=True)
class EmbedLimits:
    max_inputs: int = DEFAULT_MAX_INPUTS
    max_input_tokens: int = DEFAULT_MAX_INPUT_TOKENS
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS


@dataclass(frozen=True)
class EmbedResult:
    vectors: torch.Tensor  # (inputs, dimensions) float32, unit rows
    num_tokens: tuple[int, ...]  # per input
    queued_s: float
    compute_s: float


def check_request(
    inputs: Sequence[EmbedInput], dimensions: int, model: StaticEmbedder, limits: EmbedLimits
) -> int:
    """The dimensions to compute (0: the model's own); InvalidRequestError naming what is
    wrong. What needs no tokenizing is checked here, before the request queues."""
    if not inputs:
        raise InvalidRequestError("'input' is empty: send at least one text or token array")
    if len(inputs) > limits.max_inputs:
        raise InvalidRequestError(
            f"'input' has {len(inputs)} items; this model takes at most "
            f"{limits.max_inputs} per request"
        )
    for i, item in enumerate(inputs):
        if len(item) == 0:
            raise InvalidRequestError(f"'input'[{i}] is empty: every input needs some text")
    dims = dimensions or model.dimensions
    if dims not in model.allowed_dimensions:
        raise InvalidRequestError(
            f"'dimensions' {dimensions} is not supported by {model.name}: it makes "
            f"embeddings of {list(model.allowed_dimensions)} dimensions"
        )
    return dims


def token_ids(
    inputs: Sequence[EmbedInput], model: StaticEmbedder, limits: EmbedLimits
) -> list[list[int]]:
    """Each input's token ids (texts tokenized in one batch); InvalidRequestError for an
    input past max_input_tokens or holding an id outside the vocabulary."""
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    ids: list[list[int]] = [[] if isinstance(x, str) else list(x) for x in inputs]
    for (i, _), tokens in zip(texts, model.tokenize([t for _, t in texts]), strict=True):
        ids[i] = tokens
    for i, tokens in enumerate(ids):
        if len(tokens) > limits.max_input_tokens:
            raise InvalidRequestError(
                f"'input'[{i}] has {len(tokens)} tokens; {model.name} takes at most "
                f"{limits.max_input_tokens} tokens per input. Shorten or split it"
            )
        if not tokens:
            raise InvalidRequestError(f"'input'[{i}] has no tokens")
        bad = [t for t in tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"'input'[{i}] holds token id {bad[0]}, outside {model.name}'s vocabulary "
                f"(0..{model.vocab_size - 1})"
            )
    return ids


class EmbedMetrics:
    """``kvflow_worker_embedding_*``: requests, inputs, tokens and batch time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "kvflow_worker_embedding_"
        self.requests = Counter(p + "requests", "Embed requests answered", registry=registry)
        self.inputs = Counter(p + "inputs", "Inputs embedded", registry=registry)
        self.tokens = Counter(p + "tokens", "Input tokens embedded", registry=registry)
        self.rejected = Counter(
            p + "requests_rejected", "Embed requests refused", ["reason"], registry=registry
        )
        self.compute = Histogram(
            p + "compute_seconds", "Tokenizing and forward pass of one request",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )  # fmt: skip


class EmbedService:
    def __init__(
        self, model: StaticEmbedder, limits: EmbedLimits, metrics: EmbedMetrics | None = None
    ) -> None:
        self.model = model
        self.limits = limits
        self.metrics = metrics
        self.num_in_flight = 0  # queued or computing
        # One thread: batches run one after another, each using torch's own threads.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")

    async def embed(self, inputs: Sequence[EmbedInput], dimensions: int = 0) -> EmbedResult:
        try:
            dims = check_request(inputs, dimensions, self.model, self.limits)
        except InvalidRequestError:
            self._count_rejected("invalid")
            raise
        if self.num_in_flight >= self.limits.max_waiting_requests:
            self._count_rejected("queue_full")
            raise QueueFullError(
                f"this embedding worker has {self.limits.max_waiting_requests} requests in "
                "flight (--max-waiting-requests); try another worker",
                retry_after_s=RETRY_AFTER_S,
            )
        arrived_s = time.perf_counter()
        self.num_in_flight += 1
        started: list[float] = []

        def compute() -> tuple[torch.Tensor, list[list[int]]]:
            started.append(time.perf_counter())
            ids = token_ids(inputs, self.model, self.limits)
            return self.model.embed(ids, dims), ids

        future = asyncio.get_running_loop().run_in_executor(self._executor, compute)
        try:
            vectors, ids = await future
        except InvalidRequestError:
            self._count_rejected("invalid")
            raise
        finally:
            self.num_in_flight -= 1
        done_s = time.perf_counter()
        begun_s = started[0] if started else arrived_s
        num_tokens = tuple(len(t) for t in ids)
        if self.metrics is not None:
            self.metrics.requests.inc()
            self.metrics.inputs.inc(len(ids))
            self.metrics.tokens.inc(sum(num_tokens))
            self.metrics.compute.observe(done_s - begun_s)
        return EmbedResult(vectors, num_tokens, begun_s - arrived_s, done_s - begun_s)

    def _count_rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
