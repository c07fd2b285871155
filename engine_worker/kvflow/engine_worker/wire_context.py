"""A request's RequestContext as the worker reads it off the wire."""

from __future__ import annotations

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.priority_class import PriorityClass


def request_context(request: pb.GenerateRequest | pb.PrefillRequest) -> pb.RequestContext:
    """The request's context; from its deprecated loose fields when a router older than
    RequestContext sent it (a pool upgrades routers and workers one at a time)."""
    if request.HasField("context"):
        return request.context
    return pb.RequestContext(
        tenant=request.tenant,
        cache_salt=request.cache_salt,
        priority=request.priority,
        num_public_blocks=request.num_public_blocks,
    )


def priority_class(context: pb.RequestContext) -> PriorityClass:
    """The request's class; normal when the router predates classes (the field is unset)."""
    return PriorityClass.from_pb(context.priority_class)
