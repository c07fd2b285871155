"""Disaggregated serving with an int8 KV cache across real worker processes: the decode worker
continues from quantized blocks a prefill worker shipped (values and scales) exactly as it
would from its own, in about a quarter of the float32 cache's wire bytes; and a decode
worker whose KV dtype differs is refused by name before anything moves."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from testkit import pd_client as pc
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb

pytestmark = [pytest.mark.integration]

N_OUT = 12
PROMPT = [(i * 41) % 470 + 9 for i in range(90)]  # 80 tokens to ship: 5 blocks


@pytest.fixture(scope="module")
def workers(tiny_model: Path) -> Iterator[dict[str, WorkerProcess]]:
    """An int8 prefill worker, an int8 decode worker and a decode worker on the model's
    own dtype, all over TCP."""
    common = ["--model", str(tiny_model), "--kv-transport", "tcp", "--num-kv-blocks", "64"]
    plan = {
        "prefill": ["--role", "prefill", "--kv-cache-dtype", "int8"],
        "decode": ["--role", "decode", "--kv-cache-dtype", "int8"],
        "decode-auto": ["--role", "decode"],
    }
    with ThreadPoolExecutor(3) as pool:
        futures = {
            k: pool.submit(launch_worker, [*common, *a], timeout_s=120) for k, a in plan.items()
        }
    started = {k: f.result() for k, f in futures.items() if f.exception() is None}
    try:
        assert len(started) == 3, [f.exception() for f in futures.values()]
        yield started
    finally:
        for w in started.values():
            w.stop(timeout_s=10)


def test_int8_blocks_shipped_continue_as_the_decode_workers_own(
    workers: dict[str, WorkerProcess],
) -> None:
    pre, dec = pc.stub(workers["prefill"].address), pc.stub(workers["decode"].address)
    run = pc.disaggregated(dec, pre, "pd-int8", PROMPT, N_OUT)
    assert run.prefill is not None, run.prefill_error
    assert run.reservation.kv_layout.endswith("/int8+float16scales")
    assert run.prefill.num_sent_blocks == 5
    # The tiny model: 2 layers, 2 KV heads of 16 values + a 2-byte scale, 16-token blocks.
    assert run.prefill.num_sent_bytes == 5 * 2 * 2 * 16 * 2 * (16 + 2)
    # The decode worker computing the same prompt itself, under a salt of its own (so no
    # block of the transfer is a prefix-cache hit for it).
    ref = pb.GenerateRequest(
        request_id="ref-int8", prompt_token_ids=PROMPT, cache_salt="own",
        sampling=pc.greedy(PROMPT, N_OUT),
    )  # fmt: skip
    messages = list(dec.Generate(ref, timeout=120))
    assert messages[-1].usage.cached_tokens == 0
    assert run.tokens == [t for m in messages for t in m.token_ids]
    pc.wait_idle(dec)
    pc.wait_idle(pre)


def test_a_decode_worker_with_another_kv_dtype_is_refused_by_name(
    workers: dict[str, WorkerProcess],
) -> None:
    pre = pc.stub(workers["prefill"].address)
    dec = pc.stub(workers["decode-auto"].address)
    run = pc.disaggregated(dec, pre, "pd-mixed", PROMPT, N_OUT, timeout_s=2.0)
    error = run.prefill_error
    assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = error.details() or ""
    assert "KV dtypes differ" in message and "--kv-cache-dtype" in message
    assert "'float32'" in message and "'int8+float16scales'" in message
    # The decode worker never got blocks: it prefilled itself at its deadline and answered.
    assert run.final is not None and run.final.usage.remote_tokens == 0
    assert len(run.tokens) == N_OUT
    pc.wait_idle(dec)
    pc.wait_idle(pre)
