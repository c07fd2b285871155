"""The embedding worker's model and service: equal to WordLlama's own inference, Matryoshka
dimensions renormalized as WordLlama does, a batch equal to its inputs one by one, and the
limits each refused with a message naming them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from embed.wordllama_reference import load_wordllama

from kvflow.engine_worker.core.errors import InvalidRequestError, QueueFullError
from kvflow.engine_worker.embed.model import StaticEmbedder
from kvflow.engine_worker.embed.model_files import embedding_model_files
from kvflow.engine_worker.embed.service import (
    EmbedLimits,
    EmbedService,
    check_request,
    token_ids,
)
from kvflow.engine_worker.model.errors import ModelLoadError

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "hello",
    "Embeddings turn text into vectors; similar texts get nearby vectors.",
    "Ünïcødé, emoji 🙂 and 日本語 go through byte fallback",
    "word " * 400,  # long: no truncation, as WordLlama
]


@pytest.fixture(scope="module")
def model() -> StaticEmbedder:
    return StaticEmbedder.load(embedding_model_files(None))


@pytest.mark.parametrize("dims", [256, 128, 64])
def test_equals_wordllama_embed_with_norm(model: StaticEmbedder, dims: int) -> None:
    reference = load_wordllama(None if dims == 256 else dims)
    expected = reference.embed(TEXTS, norm=True)
    ours = model.embed(model.tokenize(TEXTS), dims).numpy()
    assert ours.shape == (len(TEXTS), dims)
    np.testing.assert_allclose(ours, expected, atol=1e-6, rtol=0)


def test_tokens_as_wordllama_tokenizes(model: StaticEmbedder) -> None:
    reference = load_wordllama()
    expected = [
        [t for t, m in zip(e.ids, e.attention_mask, strict=True) if m]
        for e in reference.tokenize(TEXTS)
    ]
    assert model.tokenize(TEXTS) == expected


def test_fewer_dimensions_are_the_leading_ones_renormalized(model: StaticEmbedder) -> None:
    ids = model.tokenize(TEXTS)
    full = model.embed(ids, 256)
    for dims in (64, 128):
        cut = full[:, :dims] / full[:, :dims].norm(dim=1, keepdim=True)
        torch.testing.assert_close(model.embed(ids, dims), cut, atol=1e-6, rtol=0)
        torch.testing.assert_close(
            model.embed(ids, dims).norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0
        )


def test_batch_equals_inputs_one_by_one(model: StaticEmbedder) -> None:
    ids = model.tokenize(TEXTS)
    batched = model.embed(ids, 256)
    for i, one in enumerate(ids):
        assert torch.equal(model.embed([one], 256)[0], batched[i])


def test_token_ids_embed_as_their_text(model: StaticEmbedder) -> None:
    limits = EmbedLimits()
    ids = model.tokenize(TEXTS[:2])
    assert token_ids([ids[0], TEXTS[1]], model, limits) == ids


def test_limits_refused_with_their_names(model: StaticEmbedder) -> None:
    limits = EmbedLimits(max_inputs=3, max_input_tokens=10)
    with pytest.raises(InvalidRequestError, match="'input' is empty"):
        check_request([], 0, model, limits)
    with pytest.raises(InvalidRequestError, match="at most 3 per request"):
        check_request(["a"] * 4, 0, model, limits)
    with pytest.raises(InvalidRequestError, match=r"'input'\[1\] is empty"):
        check_request(["a", ""], 0, model, limits)
    with pytest.raises(InvalidRequestError, match=r"\[64, 128, 256\]"):
        check_request(["a"], 100, model, limits)
    assert check_request(["a"], 0, model, limits) == 256
    assert check_request(["a"], 64, model, limits) == 64
    with pytest.raises(InvalidRequestError, match=r"'input'\[1\] has 12 tokens.*at most 10"):
        token_ids(["a", "a " * 11], model, limits)
    with pytest.raises(InvalidRequestError, match="token id 32000, outside"):
        token_ids([[1, 32000]], model, limits)
    with pytest.raises(InvalidRequestError, match="token id -1, outside"):
        token_ids([[-1]], model, limits)


def test_unknown_model_says_which_it_serves() -> None:
    with pytest.raises(ModelLoadError, match="wordllama-l2-supercat"):
        embedding_model_files("text-embedding-3-small")


def test_service_refuses_past_its_queue_bound(model: StaticEmbedder) -> None:
    async def run() -> None:
        service = EmbedService(model, EmbedLimits(max_waiting_requests=1))
        first = asyncio.create_task(service.embed(["x " * 2000] * 64))
        await asyncio.sleep(0)  # the first is in flight
        with pytest.raises(QueueFullError, match="1 requests in flight"):
            await service.embed(["y"])
        result = await first
        assert result.vectors.shape == (64, 256)
        assert service.num_in_flight == 0
        assert (await service.embed(["hello world"], 64)).num_tokens == (2,)
        service.close()

    asyncio.run(run())
