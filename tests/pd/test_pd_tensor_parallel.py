"""Prefill/decode disaggregation between tensor-parallel workers, real processes.

A worker split over ranks sends and receives whole blocks (every KV head: its rank 0
gathers the ranks' shares before a send and scatters them after a receive), so equal
splits work, and so do unequal ones: a 2-rank prefill worker hands its prompt's KV to a
1-rank decode worker and the reverse, token for token what a colocated worker answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from testkit import pd_client as pc
from testkit.tiny_model import write_tiny_llama
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

N_OUT = 10


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query and 2 KV heads: one KV head per rank at tensor-parallel size 2.
    return write_tiny_llama(
        tmp_path_factory.mktemp("pd-tp") / "tiny", vocab_size=512, seed=5, num_key_value_heads=2
    )


@pytest.fixture(scope="module", params=["tcp", "gloo"])
def workers(request: pytest.FixtureRequest, gqa_model: Path) -> Iterator[dict[str, WorkerProcess]]:
    """A colocated reference; prefill and decode workers over 2 ranks and over 1."""
    common = ["--model", str(gqa_model), "--kv-transport", request.param, "--num-kv-blocks", "96"]
    roles = {
        "ref": ["--role", "both"],
        "prefill2": ["--role", "prefill", "--tensor-parallel-size", "2"],
        "decode2": ["--role", "decode", "--tensor-parallel-size", "2"],
        "prefill1": ["--role", "prefill"],
        "decode1": ["--role", "decode"],
    }
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = {
            name: pool.submit(launch_worker, [*common, *args], timeout_s=180)
            for name, args in roles.items()
        }
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        assert len(started) == len(roles), [f.exception() for f in futures.values()]
        yield started
    finally:
        for worker in started.values():
            worker.stop(timeout_s=20)


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [("prefill2", "decode2"), ("prefill2", "decode1"), ("prefill1", "decode2")],
    ids=["2-to-2", "2-to-1", "1-to-2"],
)
def test_split_workers_hand_off_kv_as_whole_blocks(
    workers: dict[str, WorkerProcess], prefill: str, decode: str
) -> None:
    ref, pre, dec = (pc.stub(workers[n].address) for n in ("ref", prefill, decode))
    seed = len(prefill) * 7 + int(prefill[-1]) * 3 + int(decode[-1])  # a prompt per pairing:
    for length in (17, 70):  # nothing either side cached from another case
        prompt = [(i * 31 + length * seed) % 500 + 5 for i in range(length)]
        want = pc.colocated(ref, f"ref-{prefill}-{decode}-{length}", prompt, N_OUT)
        run = pc.disaggregated(dec, pre, f"pd-{prefill}-{decode}-{length}", prompt, N_OUT)
        lacking = (length - 1) // 16 * 16
        assert run.prefill is not None, run.prefill_error
        assert run.prefill.num_sent_blocks == lacking // 16
        assert run.final is not None and run.final.usage.remote_tokens == lacking
        assert run.tokens == want
        pc.wait_idle(dec)
        pc.wait_idle(pre)
