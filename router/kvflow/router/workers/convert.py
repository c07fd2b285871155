"""Typed records <-> kvflow.worker.v1 messages. The only place the router builds or reads
the worker's wire format (the probes' Health aside)."""

from __future__ import annotations

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.workers.book import LoadReport
from kvflow.router.workers.records import (
    FinishReason,
    GenerateInput,
    KvReservation,
    PrefillInput,
    PrefillResult,
    TokenChunk,
    TokenLogprobs,
    WorkerContext,
    WorkerUsage,
)

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def to_sampling_params(s: SamplingOptions) -> pb.SamplingParams:
    params = pb.SamplingParams(
        top_k=s.top_k,
        min_p=s.min_p,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
    )
    if s.repetition_penalty != 1.0:
        params.repetition_penalty = s.repetition_penalty
    if s.temperature is not None:
        params.temperature = s.temperature
    if s.top_p is not None:
        params.top_p = s.top_p
    if s.seed is not None:
        params.seed = s.seed % 2**64
    if s.max_tokens is not None:
        params.max_tokens = s.max_tokens
    return params


def to_request_context(c: WorkerContext) -> pb.RequestContext:
    return pb.RequestContext(tenant=c.tenant, cache_salt=c.cache_salt, priority=c.priority,
                             num_public_blocks=c.num_public_blocks,
                             priority_class=c.priority_class.to_pb())  # fmt: skip


def _copy_legacy(c: WorkerContext, request: pb.GenerateRequest | pb.PrefillRequest) -> None:
    """The context's deprecated loose copies, filled while workers that predate
    RequestContext may be in a pool: such a worker reads only these, and without them it
    would run every tenant under one empty cache salt during a rolling upgrade."""
    request.tenant, request.cache_salt = c.tenant, c.cache_salt
    request.priority, request.num_public_blocks = c.priority, c.num_public_blocks


def to_generate_request(g: GenerateInput) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        request_id=g.request_id,
        prompt_token_ids=g.prompt_token_ids,
        sampling=to_sampling_params(g.sampling),
        context=to_request_context(g.context),
    )
    _copy_legacy(g.context, request)
    constraint = g.sampling.constraint
    if constraint is not None:
        out = request.structured_output
        if constraint.kind == "json_object":
            out.json_object = True
        else:
            setattr(out, constraint.kind, constraint.source)
    if g.remote_prefill_timeout_s is not None:
        request.remote_prefill.version = pb.KV_HANDOFF_VERSION_1
        request.remote_prefill.timeout_s = g.remote_prefill_timeout_s
    return request


def from_generate_response(message: pb.GenerateResponse) -> TokenChunk | KvReservation:
    if message.HasField("kv_reservation"):
        r = message.kv_reservation
        return KvReservation(r.first_token, r.end_token, r.SerializeToString())
    logprobs: tuple[TokenLogprobs, ...] = ()
    if message.logprobs:  # only when the request asked for them
        logprobs = tuple(
            TokenLogprobs(lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
            for lp in message.logprobs
        )
    usage = None
    if message.HasField("usage"):
        u = message.usage
        usage = WorkerUsage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.remote_tokens)
    return TokenChunk(
        token_ids=message.token_ids,
        logprobs=logprobs,
        finish_reason=_FINISH_REASONS.get(message.finish_reason),
        usage=usage,
    )


def to_prefill_request(p: PrefillInput, destination: KvReservation) -> pb.PrefillRequest:
    request = pb.PrefillRequest(
        request_id=p.request_id,
        prompt_token_ids=p.prompt_token_ids,
        context=to_request_context(p.context),
        destination=pb.KvReservation.FromString(destination.wire),
    )
    _copy_legacy(p.context, request)
    return request


def from_prefill_response(r: pb.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        num_computed_tokens=r.num_computed_tokens,
        num_cached_tokens=r.num_cached_tokens,
        num_sent_blocks=r.num_sent_blocks,
        num_sent_bytes=r.num_sent_bytes,
        queued_s=r.queued_s,
        prefill_s=r.prefill_s,
        transfer_s=r.transfer_s,
    )


def from_load_response(load: pb.LoadResponse, block_size: int) -> LoadReport:
    """A Load answer in tokens (its block counts times the worker's ``block_size``)."""
    return LoadReport(
        num_waiting=load.num_waiting,
        num_running=load.num_running,
        kv_usage=load.kv_usage,
        max_waiting_requests=load.max_waiting_requests,
        queue_drain_rate_per_s=load.queue_drain_rate_per_s,
        num_prefill_tokens=load.num_prefill_tokens,
        num_decode_seqs=load.num_decode_seqs,
        num_kv_tokens=load.num_kv_tokens,
        kv_capacity_tokens=load.num_total_blocks * block_size,
        num_cached_tokens=load.num_cached_blocks * block_size,
    )
