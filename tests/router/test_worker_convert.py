"""The worker client's conversions (typed records <-> kvflow.worker.v1) and the request id
taken from `x-request-id`: exact fields, both directions."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvflow.proto import worker_pb2 as pb
from kvflow.router.api.http import request_id_from
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.workers.convert import (
    from_generate_response,
    from_prefill_response,
    to_generate_request,
    to_prefill_request,
    to_sampling_params,
)
from kvflow.router.workers.records import (
    GenerateInput,
    KvReservation,
    PrefillInput,
    TokenChunk,
    WorkerContext,
    WorkerUsage,
)

SAMPLING = SamplingOptions(max_tokens=8, temperature=0.0, top_p=None, top_k=5, min_p=0.0,
                           seed=None, stop_strings=("x",), stop_token_ids=(7,), n=1,
                           logprobs=True, top_logprobs=2, ignore_eos=False)  # fmt: skip


def test_sampling_options_become_sampling_params() -> None:
    params = to_sampling_params(SAMPLING)
    assert params.temperature == 0.0 and params.HasField("temperature")
    assert not params.HasField("top_p") and not params.HasField("seed")
    assert (params.top_k, params.max_tokens, list(params.stop_token_ids)) == (5, 8, [7])
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    # A seed past uint64 (seed + choice index) wraps instead of failing to serialize.
    assert to_sampling_params(replace(SAMPLING, seed=2**64 + 3)).seed == 3


def test_generate_input_with_and_without_remote_prefill() -> None:
    g = GenerateInput("r-c0-a0", [1, 2, 3], SAMPLING, WorkerContext("salt", 2, 1))
    request = to_generate_request(g)
    assert (request.request_id, list(request.prompt_token_ids)) == ("r-c0-a0", [1, 2, 3])
    ctx = request.context
    assert (ctx.cache_salt, ctx.priority, ctx.num_public_blocks, ctx.tenant) == ("salt", 2, 1, "")
    # The deprecated loose copies too, for workers that predate RequestContext (a worker
    # that knows it reads the context).
    assert (request.cache_salt, request.priority, request.num_public_blocks) == ("salt", 2, 1)
    assert not request.HasField("remote_prefill")
    acme = replace(g, context=WorkerContext("salt", tenant="acme"))
    assert to_generate_request(acme).context.tenant == to_generate_request(acme).tenant == "acme"
    request = to_generate_request(replace(g, remote_prefill_timeout_s=2.5))
    assert request.remote_prefill.version == pb.KV_HANDOFF_VERSION_1
    assert request.remote_prefill.timeout_s == 2.5


def test_responses_become_chunks_and_reservations() -> None:
    reservation = pb.KvReservation(version=pb.KV_HANDOFF_VERSION_1, transfer_id="t1",
                                   first_token=16, end_token=64, kv_layout="L2", tag=9)  # fmt: skip
    got = from_generate_response(pb.GenerateResponse(request_id="r", kv_reservation=reservation))
    assert isinstance(got, KvReservation)
    assert (got.first_token, got.end_token, got.num_tokens) == (16, 64, 48)
    # Handed on verbatim to the prefill worker.
    context = WorkerContext("s", 1, 0, "acme")
    prefill = to_prefill_request(PrefillInput("r", [1] * 70, context), got)
    assert prefill.destination == reservation
    assert (prefill.request_id, len(prefill.prompt_token_ids)) == ("r", 70)
    # The prefill half carries the same context as its decode half.
    decode = to_generate_request(GenerateInput("r", [1], SAMPLING, context))
    assert prefill.context == decode.context
    assert (prefill.cache_salt, prefill.priority, prefill.tenant) == ("s", 1, "acme")

    final = pb.GenerateResponse(
        token_ids=[4, 5],
        logprobs=[pb.TokenLogprobs(logprob=-0.5, top_token_ids=[4], top_logprobs=[-0.5])] * 2,
        finish_reason=pb.FINISH_REASON_LENGTH,
        usage=pb.Usage(prompt_tokens=70, completion_tokens=2, cached_tokens=16, remote_tokens=48),
    )
    chunk = from_generate_response(final)
    assert isinstance(chunk, TokenChunk)
    assert list(chunk.token_ids) == [4, 5] and chunk.finish_reason == "length"
    assert chunk.logprobs[1].logprob == -0.5 and list(chunk.logprobs[1].top_token_ids) == [4]
    assert chunk.usage == WorkerUsage(70, 2, 16, 48)
    middle = from_generate_response(pb.GenerateResponse(token_ids=[3]))
    assert isinstance(middle, TokenChunk) and middle.finish_reason is None
    assert middle.usage is None and middle.logprobs == ()


def test_prefill_response() -> None:
    response = pb.PrefillResponse(
        num_computed_tokens=48, num_sent_blocks=3, num_sent_bytes=4096, transfer_s=0.25
    )
    result = from_prefill_response(response)
    assert (result.num_computed_tokens, result.num_sent_blocks) == (48, 3)
    assert (result.num_sent_bytes, result.transfer_s) == (4096, 0.25)


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        (b"4bf92f3577b34da6a3ce929d0e0e4736", True),
        (b"req-01:edge.7_a", True),
        (b"x" * 128, True),
        (b"x" * 129, False),
        (b"", False),
        (b"has space", False),
        (b"line\nbreak", False),
        (b"caf\xc3\xa9", False),
    ],
)
def test_request_id_from_the_callers_header_when_plain(header: bytes, kept: bool) -> None:
    got = request_id_from([(b"accept", b"*/*"), (b"x-request-id", header)])
    assert (got == header.decode("latin-1")) == kept
    if not kept:
        assert got.startswith("req_") and len(got) == 36
    assert request_id_from([]).startswith("req_")
