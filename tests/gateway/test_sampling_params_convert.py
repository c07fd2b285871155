"""Router sampling options -> wire -> worker sampling params: every new field survives the
trip, and unset ones keep their meaning (repetition_penalty unset is 1, off)."""

from dataclasses import replace

from kvflow.engine_worker.wire_convert import sampling_from_proto
from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.requests import parse_chat_request
from kvflow.router.workers.convert import to_sampling_params

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def round_trip(body: dict) -> object:
    options = parse_chat_request({**CHAT, **body}).sampling
    wire = pb.SamplingParams.FromString(to_sampling_params(options).SerializeToString())
    return sampling_from_proto(wire)


def test_penalties_bias_and_min_tokens_reach_the_worker() -> None:
    params = round_trip(
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -1.25,
            "repetition_penalty": 1.5,
            "logit_bias": {"9": -100, "3": 2.5},
            "min_tokens": 6,
            "max_tokens": 10,
        }
    )
    assert params == replace(
        round_trip({"max_tokens": 10}),
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        repetition_penalty=1.5,
        logit_bias=((3, 2.5), (9, -100.0)),
        min_tokens=6,
    )


def test_unset_fields_mean_off() -> None:
    params = round_trip({})
    assert (params.presence_penalty, params.frequency_penalty) == (0.0, 0.0)
    assert (params.repetition_penalty, params.logit_bias, params.min_tokens) == (1.0, (), 0)
    assert not params.has_penalties
    wire = to_sampling_params(parse_chat_request(CHAT).sampling)
    assert not wire.HasField("repetition_penalty")
