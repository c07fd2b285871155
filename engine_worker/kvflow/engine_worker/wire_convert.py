"""The engine's records to and from kvflow.worker.v1 protobuf: sampling parameters in, a
request's outputs and a decode-side KV reservation out.

Pure translation, no I/O and no gRPC: the service (``server``) calls these at its edge so
that nothing past it sees a protobuf message, and a test can check a field's mapping
without a server.
"""

from __future__ import annotations

from kvflow.engine_worker.core.engine import RequestOutput
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.loop_records import KvReservationOut
from kvflow.proto import worker_pb2 as pb

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def sampling_from_proto(s: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_k=s.top_k,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple(sorted(s.logit_bias.items())),
        min_tokens=s.min_tokens,
    )


def reservation_to_proto(
    r: KvReservationOut, *, instance_id: str, kv_layout: str
) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=r.request_id)
    res = msg.kv_reservation
    res.version = pb.KV_HANDOFF_VERSION_1
    res.decode_instance_id = instance_id
    res.first_token = r.first_token
    res.end_token = r.end_token
    res.kv_layout = kv_layout
    if r.ticket is not None:
        res.transfer_id = r.ticket.transfer_id
        res.transport = r.ticket.kind.to_pb()
        res.endpoint = r.ticket.endpoint
        res.tag = r.ticket.tag
        res.deadline_s = r.ticket.timeout_s
    return msg


def output_to_proto(out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id)
    msg.token_ids.extend(t.token_id for t in out.new_tokens)
    for t in out.new_tokens:
        if t.logprob is not None:
            msg.logprobs.add(
                logprob=t.logprob, top_token_ids=t.top_token_ids, top_logprobs=t.top_logprobs
            )
    if out.finish_reason is not None:
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
        msg.usage.prompt_tokens = out.num_prompt_tokens
        msg.usage.completion_tokens = out.num_output_tokens
        msg.usage.cached_tokens = out.num_cached_tokens
        msg.usage.remote_tokens = out.num_remote_tokens
        if out.timings is not None:
            msg.timings.queued_s = out.timings.queued_s
            msg.timings.ttft_s = out.timings.ttft_s
            msg.timings.e2e_s = out.timings.e2e_s
            msg.timings.num_preemptions = out.timings.num_preemptions
    return msg
