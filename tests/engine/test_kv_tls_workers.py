"""Prefill/decode between real `kvflow worker` processes whose KV port runs mutual TLS from
the worker gRPC flags (``--tls-*``, ``--kv-tls auto``), as the operator starts a pool with
``spec.workerTls``: KV lands and decode emits what colocated serving does. A prefill worker
without the pool's TLS is refused at the decode worker's KV port: decode computes the
prompt itself (same tokens, none received) and both workers free everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from testkit import pd_client as pc
from testkit.certs import SERVICE_NAME, make_certs
from testkit.tiny_model import write_tiny_llama
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

N_OUT = 8
PROMPT = [(i * 53) % 470 + 7 for i in range(150)]  # 144 tokens to ship: 9 blocks


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kv-tls")
    make_certs(d)
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("kv-tls-model") / "tiny", seed=3)


def tls_args(certs: Path) -> list[str]:
    return ["--tls-cert-file", str(certs / "server.pem"),
            "--tls-key-file", str(certs / "server.key"),
            "--tls-ca-file", str(certs / "ca.pem"),
            "--kv-tls-server-name", SERVICE_NAME]  # fmt: skip


def start(model: Path, role: str, extra: list[str]) -> WorkerProcess:
    return launch_worker(
        ["--model", str(model), "--role", role, "--kv-transport", "tcp",
         "--num-kv-blocks", "64", *extra],
        timeout_s=120,
    )  # fmt: skip


def stub(worker: WorkerProcess, certs: Path | None) -> pb_grpc.WorkerStub:
    if certs is None:
        return pc.stub(worker.address)
    credentials = grpc.ssl_channel_credentials(
        (certs / "ca.pem").read_bytes(),
        (certs / "client.key").read_bytes(),
        (certs / "client.pem").read_bytes(),
    )
    return pb_grpc.WorkerStub(grpc.secure_channel(worker.address, credentials))


@pytest.fixture(scope="module")
def decode(model: Path, certs: Path) -> Iterator[WorkerProcess]:
    w = start(model, "decode", tls_args(certs))
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def reference(decode: WorkerProcess, certs: Path) -> list[int]:
    return pc.colocated(stub(decode, certs), "ref", PROMPT, N_OUT)


def test_kv_moves_between_workers_over_tls(
    model: Path, certs: Path, decode: WorkerProcess, reference: list[int]
) -> None:
    prefill = start(model, "prefill", tls_args(certs))
    try:
        dec, pre = stub(decode, certs), stub(prefill, certs)
        run = pc.disaggregated(dec, pre, "tls", PROMPT, N_OUT, salt="tls")
        assert run.prefill_error is None, run.prefill_error
        assert run.final is not None and run.final.usage.remote_tokens == 144
        assert run.tokens == reference
        pc.wait_idle(dec)
        pc.wait_idle(pre)
    finally:
        prefill.stop(timeout_s=10)


def test_a_prefill_worker_without_the_pools_tls_is_refused_and_decode_computes(
    model: Path, certs: Path, decode: WorkerProcess, reference: list[int]
) -> None:
    prefill = start(model, "prefill", [])  # plaintext KV, no certificate
    try:
        dec, pre = stub(decode, certs), stub(prefill, None)
        run = pc.disaggregated(dec, pre, "plain", PROMPT, N_OUT, timeout_s=2.0, salt="plain")
        assert run.prefill_error is not None  # the KV stream broke at the handshake
        assert run.final is not None and run.final.usage.remote_tokens == 0
        assert run.tokens == reference
        pc.wait_idle(dec)
        pc.wait_idle(pre)
    finally:
        prefill.stop(timeout_s=10)
