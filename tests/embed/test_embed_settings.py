"""`kvflow worker --task embed`: its flags, what it refuses, and what it announces."""

from __future__ import annotations

import pytest

from kvflow.engine_worker.embed.app import build_embed_service
from kvflow.engine_worker.settings import parse_args
from kvflow.proto import worker_pb2 as pb


def test_embed_flags_reach_the_worker_info() -> None:
    flags = ["--max-embedding-inputs", "16", "--max-embedding-input-tokens", "128"]
    settings = parse_args(["--task", "embed", *flags, "--served-model-name", "e"])
    service, info = build_embed_service(settings)
    try:
        assert (info.model, info.task) == ("e", pb.TASK_EMBED)
        assert info.embedding.dimensions == 256
        assert list(info.embedding.allowed_dimensions) == [64, 128, 256]
        assert (info.embedding.max_inputs, info.embedding.max_input_tokens) == (16, 128)
        assert service.limits.max_waiting_requests == 256  # --max-waiting-requests' default
    finally:
        service.close()


@pytest.mark.parametrize(
    "flags",
    [
        ["--simulate"],
        ["--tensor-parallel-size", "2"],
        ["--role", "decode"],
        ["--max-embedding-inputs", "0"],
        ["--max-embedding-input-tokens", "0"],
    ],
)
def test_flags_an_embedding_worker_cannot_honour_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--task", "embed", *flags])
    assert "--" in capsys.readouterr().err


def test_generation_is_the_default_task() -> None:
    assert parse_args([]).task == "generate"
