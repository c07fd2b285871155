"""Worker gRPC over mutual TLS from certificate files: a real `kvflow worker` process with
certificates that openssl makes here. A caller with a certificate the CA signed is served;
one with a certificate of its own making, none, or a plaintext channel is turned away
before any handler runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from testkit.certs import make_certs
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.engine_worker.settings import parse_args
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    make_certs(d)
    return d


@pytest.fixture(scope="module")
def worker(certs: Path) -> Iterator[WorkerProcess]:
    w = launch_worker(
        ["--simulate", "--num-kv-blocks", "64", "--host", "127.0.0.1",
         "--tls-cert-file", str(certs / "server.pem"), "--tls-key-file", str(certs / "server.key"),
         "--tls-ca-file", str(certs / "ca.pem")],
        timeout_s=60,
    )  # fmt: skip
    yield w
    w.stop(timeout_s=10)


def health(channel: grpc.Channel) -> pb.HealthResponse:
    return pb_grpc.WorkerStub(channel).Health(pb.HealthRequest(), timeout=5)  # type: ignore[no-any-return]


def credentials(certs: Path, client: str | None) -> grpc.ChannelCredentials:
    key = (certs / f"{client}.key").read_bytes() if client else None
    chain = (certs / f"{client}.pem").read_bytes() if client else None
    return grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), key, chain)


def test_a_caller_with_a_certificate_the_ca_signed_is_served(
    worker: WorkerProcess, certs: Path
) -> None:
    with grpc.secure_channel(worker.address, credentials(certs, "client")) as channel:
        assert health(channel).is_serving


@pytest.mark.parametrize("client", ["rogue", None], ids=["self-signed", "no-certificate"])
def test_a_caller_without_such_a_certificate_is_turned_away(
    worker: WorkerProcess, certs: Path, client: str | None
) -> None:
    channel = grpc.secure_channel(worker.address, credentials(certs, client))
    with channel, pytest.raises(grpc.RpcError) as refused:
        health(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_a_plaintext_caller_is_turned_away(worker: WorkerProcess) -> None:
    with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError):
        health(channel)


def test_the_flags_go_together(certs: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--tls-cert-file", str(certs / "server.pem")])  # no key
    with pytest.raises(SystemExit):
        parse_args(["--tls-ca-file", str(certs / "ca.pem")])  # mutual TLS needs a certificate
    with pytest.raises(SystemExit):
        parse_args(["--tls-cert-file", "missing.pem", "--tls-key-file", "missing.key"])
    s = parse_args(["--tls-cert-file", str(certs / "server.pem"),
                    "--tls-key-file", str(certs / "server.key")])  # fmt: skip
    assert s.tls.is_on and s.tls.ca_file is None


def test_the_kv_port_runs_tls_with_mutual_tls_unless_turned_off(certs: Path) -> None:
    files = ["--tls-cert-file", str(certs / "server.pem"),
             "--tls-key-file", str(certs / "server.key")]  # fmt: skip
    mutual = [*files, "--tls-ca-file", str(certs / "ca.pem")]
    assert parse_args(mutual).tls.kv_tls() is not None  # auto: on with mutual TLS
    assert parse_args(files).tls.kv_tls() is None  # no CA to check peers against
    assert parse_args([*mutual, "--kv-tls", "off"]).tls.kv_tls() is None
    named = parse_args([*mutual, "--kv-tls-server-name", "p-workers.ns.svc"]).tls.kv_tls()
    assert named is not None and named.server_name == "p-workers.ns.svc"
    for refused in (
        [*files, "--kv-tls", "on"],  # mutual TLS needs the CA
        [*mutual, "--kv-tls", "on", "--kv-transport", "gloo"],  # gloo takes no TLS
        [*mutual, "--kv-tls", "off", "--kv-tls-server-name", "p-workers.ns.svc"],
    ):
        with pytest.raises(SystemExit):
            parse_args(refused)
