"""The Embed contract between router and worker (worker.proto): what each side reads from
the other is where the other puts it, and a worker that predates tasks counts as generating."""

from __future__ import annotations

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.embeddings import MAX_INT32


def test_the_worker_service_has_embed() -> None:
    method = pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name["Embed"]
    assert method.input_type.name == "EmbedRequest"
    assert method.output_type.name == "EmbedResponse"
    assert not method.server_streaming


def test_field_numbers_hold() -> None:
    info = pb.WorkerInfo.DESCRIPTOR.fields_by_name
    assert (info["task"].number, info["embedding"].number) == (12, 13)
    request = pb.EmbedRequest.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in request.items()} == {
        "request_id": 1, "inputs": 2, "dimensions": 3, "context": 4,
    }  # fmt: skip
    kind = pb.EmbedInput.DESCRIPTOR.oneofs_by_name["kind"]
    assert [f.name for f in kind.fields] == ["text", "token_ids"]


def test_a_worker_that_predates_tasks_generates() -> None:
    # The router reads TASK_EMBED as "embeds" and everything else as "generates".
    assert pb.WorkerInfo().task == pb.TASK_UNSPECIFIED == 0
    assert pb.Task.Name(2) == "TASK_EMBED"


def test_token_ids_and_dimensions_fit_the_wire() -> None:
    ids = pb.TokenIds(ids=[MAX_INT32])
    assert list(pb.TokenIds.FromString(ids.SerializeToString()).ids) == [MAX_INT32]
    assert pb.EmbedRequest.DESCRIPTOR.fields_by_name["dimensions"].type == (
        pb.EmbedRequest.DESCRIPTOR.fields_by_name["dimensions"].TYPE_INT32
    )
