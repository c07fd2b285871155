"""What makes a request one this worker cannot serve as sent: fields it does not
understand, or a KV destination it cannot send to.

Both are configuration bugs (a router or a peer of another version, a pool whose workers
differ), never load: the service refuses them with INVALID_ARGUMENT and a message that
names what to change, and a router never retries them. Pure functions of the message and
this worker's own settings, kept apart from the service so that each reads on its own.
"""

from __future__ import annotations

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from kvflow.proto import worker_pb2 as pb


def unknown_field_numbers(message: Message) -> list[int]:
    """Field numbers this worker does not understand, in the message and its sampling."""
    messages = [message]
    if isinstance(message, pb.GenerateRequest) and message.HasField("sampling"):
        messages.append(message.sampling)
    numbers: list[int] = []
    for m in messages:
        unknown = unknown_fields.UnknownFieldSet(m)
        numbers += [unknown[i].field_number for i in range(len(unknown))]
    return numbers


def destination_problem(
    dest: pb.KvReservation, *, kv_transport: pb.KvTransport, kv_layout: str
) -> str:
    """Why this worker, sending over ``kv_transport`` blocks laid out as ``kv_layout``,
    cannot serve a reservation, or "" (a config bug, never retried)."""
    if dest.version != pb.KV_HANDOFF_VERSION_1:
        return f"KV handoff version {dest.version} is not supported (this worker speaks 1)"
    if dest.transport != kv_transport:
        return (
            f"the decode worker expects KV over {pb.KvTransport.Name(dest.transport)} but "
            f"this worker sends over {pb.KvTransport.Name(kv_transport)}; give "
            "every worker of a pool the same --kv-transport"
        )
    if dest.kv_layout != kv_layout:
        shape, _, theirs = dest.kv_layout.rpartition("/")
        our_shape, _, ours = kv_layout.rpartition("/")
        if shape == our_shape:  # the same model and blocks; the KV dtype (the last field)
            return (
                f"KV dtypes differ: decode stores {theirs!r}, this worker {ours!r} "
                f"(layouts {dest.kv_layout!r}, {kv_layout!r}); give every worker of "
                "a pool the same --kv-cache-dtype and --dtype"
            )
        return (
            f"KV layouts differ: decode {dest.kv_layout!r}, this worker {kv_layout!r}; "
            "prefill and decode workers must serve the same model, dtype, KV cache dtype "
            "and block size"
        )
    if not dest.transfer_id or not dest.endpoint:
        return "the destination names no transfer: nothing to send"
    return ""
