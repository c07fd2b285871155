"""Disaggregated serving across real worker processes equals colocated serving, token for
token: the decode worker continues from KV that a prefill worker computed and shipped over
TCP or gloo, with prompts partly cached on either side and prompts of one block or less."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from testkit import pd_client as pc
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration]

N_OUT = 12


def prompt(seed: int, n: int) -> list[int]:
    return [(i * 37 + seed * 101) % 480 + 5 for i in range(n)]


@pytest.fixture(scope="module", params=["tcp", "gloo"])
def trio(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[list[WorkerProcess]]:
    """A colocated reference, a prefill and a decode worker, all on one transport."""
    common = ["--model", str(tiny_model), "--kv-transport", request.param, "--num-kv-blocks", "96"]
    with ThreadPoolExecutor(3) as pool:  # each start imports torch: in parallel
        futures = [
            pool.submit(launch_worker, [*common, "--role", role], timeout_s=120)
            for role in ("both", "prefill", "decode")
        ]
    workers = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(workers) == 3, [f.exception() for f in futures]
        yield workers
    finally:
        for w in workers:
            w.stop(timeout_s=10)


@pytest.mark.parametrize("length", [5, 16, 17, 40, 161])
def test_greedy_output_equals_colocated(trio: list[WorkerProcess], length: int) -> None:
    ref, pre, dec = (pc.stub(w.address) for w in trio)
    p = prompt(length, length)
    want = pc.colocated(ref, f"ref-{length}", p, N_OUT)
    run = pc.disaggregated(dec, pre, f"pd-{length}", p, N_OUT)
    assert run.tokens == want
    lacking = (length - 1) // 16 * 16  # full blocks short of the last token
    assert (run.reservation.first_token, run.reservation.end_token) == (0, lacking)
    assert run.final is not None and run.final.usage.remote_tokens == lacking
    if lacking:
        assert run.prefill is not None, run.prefill_error
        assert run.prefill.num_sent_blocks == lacking // 16
    else:
        assert run.prefill is None  # one block or less: nothing worth shipping
    pc.wait_idle(dec)
    pc.wait_idle(pre)


def test_decode_asks_only_for_what_it_lacks(trio: list[WorkerProcess]) -> None:
    ref, pre, dec = (pc.stub(w.address) for w in trio)
    shared = prompt(7, 64)
    pc.colocated(dec, "warm-decode", shared, 1)  # decode now caches its 4 blocks
    p = shared + prompt(8, 50)
    run = pc.disaggregated(dec, pre, "pd-partial-decode", p, N_OUT)
    assert run.tokens == pc.colocated(ref, "ref-partial-decode", p, N_OUT)
    assert (run.reservation.first_token, run.reservation.end_token) == (64, 112)
    assert run.final is not None and run.final.usage.cached_tokens == 64
    assert run.final.usage.remote_tokens == 48
    assert run.prefill is not None and run.prefill.num_sent_blocks == 3
    pc.wait_idle(dec)
    pc.wait_idle(pre)


def test_prefill_reuses_its_own_cache(trio: list[WorkerProcess]) -> None:
    _, pre, dec = (pc.stub(w.address) for w in trio)
    shared = prompt(9, 80)
    first = pc.disaggregated(dec, pre, "pd-a", shared + prompt(10, 30), N_OUT)
    assert first.prefill is not None and first.prefill.num_cached_tokens == 0
    p = shared + prompt(11, 30)
    run = pc.disaggregated(pc.stub(trio[0].address), pre, "pd-b", p, N_OUT)  # a fresh decode
    assert run.prefill is not None and run.prefill.num_cached_tokens == 80
    assert run.prefill.num_computed_tokens == (len(p) - 1) // 16 * 16 - 80
    assert run.tokens == pc.colocated(dec, "ref-b", p, N_OUT)
    for w in trio:
        pc.wait_idle(pc.stub(w.address))


def metric(worker: WorkerProcess, name: str, labels: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics").read()
    for line in body.decode().splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_both_sides_count_their_transfers(trio: list[WorkerProcess]) -> None:
    _, pre_w, dec_w = trio
    sent = metric(pre_w, "kvflow_worker_kv_transfers_total", 'direction="send",outcome="ok"')
    got = metric(dec_w, "kvflow_worker_kv_transfers_total", 'direction="receive",outcome="ok"')
    got_bytes = metric(dec_w, "kvflow_worker_kv_transfer_bytes_total", 'direction="receive"')
    run = pc.disaggregated(
        pc.stub(dec_w.address), pc.stub(pre_w.address), "pd-m", prompt(12, 70), 2
    )
    assert run.prefill is not None
    assert metric(pre_w, "kvflow_worker_kv_transfers_total",
                  'direction="send",outcome="ok"') == sent + 1  # fmt: skip
    assert metric(dec_w, "kvflow_worker_kv_transfers_total",
                  'direction="receive",outcome="ok"') == got + 1  # fmt: skip
    received = metric(dec_w, "kvflow_worker_kv_transfer_bytes_total", 'direction="receive"')
    assert received - got_bytes == run.prefill.num_sent_bytes > 0
