"""`kvflow worker --tensor-parallel-size 2`: real processes, gloo between them, gRPC in front.

One worker to its clients: the same greedy tokens as a one-rank worker on the same model,
the rank it spawned visible in its log, and a rank that dies turns its health red at once
and fails the requests in flight (they end, aborted: nothing hangs) instead of serving
wrong or no tokens.
"""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from testkit.tiny_model import write_tiny_llama
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPTS = [[5, 17, 200, 33, 9, 88, 140, 2, 77], list(range(40, 90)), [300, 301, 302]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(
        tmp_path_factory.mktemp("tp") / "tiny", vocab_size=512, seed=7, num_key_value_heads=2
    )


def greedy(worker: WorkerProcess, prompt: list[int], max_tokens: int = 16) -> list[int]:
    with grpc.insecure_channel(worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        request = pb.GenerateRequest(
            request_id=f"r{time.monotonic_ns()}",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        return [t for r in stub.Generate(request, timeout=60) for t in r.token_ids]


def health(worker: WorkerProcess) -> tuple[int, str]:
    url = f"http://127.0.0.1:{worker.metrics_port}/health"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def split_worker(tiny: Path) -> Iterator[WorkerProcess]:
    worker = launch_worker(["--model", str(tiny), "--tensor-parallel-size", "2"])
    yield worker
    worker.stop(timeout_s=20)


def test_two_ranks_answer_what_one_does(tiny: Path, split_worker: WorkerProcess) -> None:
    single = launch_worker(["--model", str(tiny)])
    try:
        expected = [greedy(single, p) for p in PROMPTS]
    finally:
        single.stop(timeout_s=10)
    assert [greedy(split_worker, p) for p in PROMPTS] == expected
    assert "rank 1 (pid" in split_worker.log
    assert health(split_worker)[0] == 200


def test_a_model_whose_heads_do_not_divide_is_refused_at_start(tmp_path: Path) -> None:
    folder = write_tiny_llama(
        tmp_path / "nine", vocab_size=576, hidden_size=72, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=96,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="9 attention heads do not divide among 2 ranks"):
        launch_worker(["--model", str(folder), "--tensor-parallel-size", "2"], timeout_s=60)


def test_a_rank_that_dies_aborts_the_step_in_flight_and_fails_health(tiny: Path) -> None:
    worker = launch_worker(["--model", str(tiny), "--tensor-parallel-size", "2"])
    try:
        follower = int(worker.log.split("rank 1 (pid ")[1].split(")")[0])
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            long = pb.GenerateRequest(
                request_id="long",
                prompt_token_ids=PROMPTS[0],
                sampling=pb.SamplingParams(temperature=0.0, max_tokens=1500, ignore_eos=True),
            )
            replies = stub.Generate(long, timeout=60)
            first = next(replies)
            assert first.token_ids
            os.kill(follower, signal.SIGKILL)
            started = time.monotonic()
            rest = list(replies)
            assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
            assert time.monotonic() - started < 10, "the step waited on the dead rank"
            status = health(worker)
            assert status[0] == 503 and "tensor-parallel rank 1" in status[1], status
            # New requests are refused at once, UNAVAILABLE: a router goes elsewhere.
            with pytest.raises(grpc.RpcError) as refused:
                list(
                    stub.Generate(
                        pb.GenerateRequest(request_id="after", prompt_token_ids=PROMPTS[1]),
                        timeout=10,
                    )
                )
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "tensor-parallel rank 1" in str(refused.value.details())
    finally:
        worker.stop(timeout_s=20)


def test_the_router_fails_over_from_a_worker_whose_rank_died(tmp_path: Path) -> None:
    """A pool of a split worker and a plain one: once the split worker's rank dies, every
    request is answered by the other, without waiting on the dead rank."""
    import openai
    from testkit.gateway_process import launch_gateway
    from testkit.tokenizer_files import write_smollm2_tokenizer

    folder = write_smollm2_tokenizer(write_tiny_llama(tmp_path / "tiny", seed=3))
    split = launch_worker(["--model", str(folder), "--tensor-parallel-size", "2",
                           "--served-model-name", "tiny"])  # fmt: skip
    plain = launch_worker(["--model", str(folder), "--served-model-name", "tiny"])
    gateway = launch_gateway(["--model", str(folder), "--served-model-name", "tiny",
                              "--workers", f"{split.address},{plain.address}"])  # fmt: skip
    try:
        gateway.wait_ready(num_workers=2)
        client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=60)
        follower = int(split.log.split("rank 1 (pid ")[1].split(")")[0])
        os.kill(follower, signal.SIGKILL)
        started = time.monotonic()
        for i in range(6):  # more than one round of round-robin over both workers
            reply = client.completions.create(
                model="tiny", prompt=f"request {i}", max_tokens=4, temperature=0
            )
            assert reply.choices[0].finish_reason in ("length", "stop")
        assert time.monotonic() - started < 60
    finally:
        gateway.stop()
        split.stop(timeout_s=20)
        plain.stop(timeout_s=10)


def _num_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.multigpu
@pytest.mark.skipif(_num_gpus() < 2, reason="needs two CUDA GPUs (NCCL); not run here")
def test_two_gpus_over_nccl_answer_what_one_does(tiny: Path) -> None:
    common = ["--model", str(tiny), "--device", "cuda", "--dtype", "float32"]
    single = launch_worker(common)
    try:
        expected = [greedy(single, p) for p in PROMPTS]
    finally:
        single.stop(timeout_s=10)
    split = launch_worker([*common, "--tensor-parallel-size", "2"])
    try:
        assert [greedy(split, p) for p in PROMPTS] == expected
    finally:
        split.stop(timeout_s=20)
