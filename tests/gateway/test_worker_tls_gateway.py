"""The gateway dials workers over mutual TLS (`--worker-tls-*`): a real worker that requires
client certificates, real gateway processes, certificates from the real openssl. With the
CA and its own certificate the gateway serves; with a certificate for the Service name
instead of the address it serves too; without TLS, or with a certificate the workers' CA
did not sign, it sees no healthy worker and answers 503, never a hang. One gateway fronts a
TLS pool and a plaintext pool together, each `pools:` entry dialled its own way."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testkit.certs import SERVICE_NAME, make_certs
from testkit.gateway_process import launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
PLAIN = "sim-plain"  # the plaintext pool's model, behind the same gateway


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    make_certs(d)
    return d


@pytest.fixture(scope="module")
def worker(certs: Path) -> Iterator[WorkerProcess]:
    w = launch_worker(
        ["--simulate", "--served-model-name", MODEL, "--host", "127.0.0.1",
         "--tls-cert-file", str(certs / "server.pem"), "--tls-key-file", str(certs / "server.key"),
         "--tls-ca-file", str(certs / "ca.pem")],
        timeout_s=60,
    )  # fmt: skip
    yield w
    w.stop(timeout_s=10)


def tls_args(certs: Path, client: str) -> list[str]:
    return ["--worker-tls-ca-file", str(certs / "ca.pem"),
            "--worker-tls-cert-file", str(certs / f"{client}.pem"),
            "--worker-tls-key-file", str(certs / f"{client}.key")]  # fmt: skip


def ask(base_url: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
    return client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text


@pytest.mark.parametrize("server_name", [None, SERVICE_NAME], ids=["by-address", "by-name"])
def test_the_gateway_serves_through_mutual_tls(
    worker: WorkerProcess, certs: Path, server_name: str | None
) -> None:
    name = [] if server_name is None else ["--worker-tls-server-name", server_name]
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        *tls_args(certs, "client"), *name])  # fmt: skip
    try:
        g.wait_ready(num_workers=1)
        assert ask(g.base_url) is not None
    finally:
        g.stop(timeout_s=10)


@pytest.mark.parametrize("how", ["plaintext", "rogue-certificate"])
def test_without_an_accepted_certificate_the_worker_is_not_reachable(
    worker: WorkerProcess, certs: Path, how: str
) -> None:
    extra = [] if how == "plaintext" else tls_args(certs, "rogue")
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address, *extra])
    try:
        time.sleep(2.0)  # a few health probes
        assert httpx.get(f"{g.url}/ready", timeout=5).json()["workers_healthy"] == 0
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            ask(g.base_url)
        assert info.value.status_code == 503 and time.monotonic() - started < 10
    finally:
        g.stop(timeout_s=10)


def test_half_a_tls_configuration_is_refused_at_start(certs: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "router", "--workers", "127.0.0.1:1",
         "--worker-tls-cert-file", str(certs / "client.pem")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--worker-tls-cert-file and --worker-tls-key-file go together" in done.stderr


@pytest.fixture(scope="module")
def plain_worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--simulate", "--served-model-name", PLAIN, "--host", "127.0.0.1"],
                      timeout_s=60)  # fmt: skip
    yield w
    w.stop(timeout_s=10)


def mixed_pools(certs: Path, tls_at: str, plain_at: str, how: str) -> dict[str, object]:
    """Two pools: `tls` (mutual TLS, its certificate for the Service name) and `plain`.
    ``how``: "own", the TLS pool says how to dial it and the plaintext one takes the flags'
    (none); "flags", the flags say TLS and the plaintext pool says plaintext (`{}`)."""
    own = {"ca_file": str(certs / "ca.pem"), "cert_file": str(certs / "client.pem"),
           "key_file": str(certs / "client.key"), "server_name": SERVICE_NAME}  # fmt: skip
    tls_pool: dict[str, object] = {"name": "tls", "workers": [tls_at]}
    plain_pool: dict[str, object] = {"name": "plain", "workers": [plain_at]}
    if how == "own":
        tls_pool["worker_tls"] = own
    else:
        plain_pool["worker_tls"] = {}
    return {"pools": [tls_pool, plain_pool]}


@pytest.mark.parametrize("how", ["own", "flags"])
def test_one_gateway_fronts_a_tls_pool_and_a_plaintext_pool(
    worker: WorkerProcess, plain_worker: WorkerProcess, certs: Path, tmp_path: Path, how: str
) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump(mixed_pools(certs, worker.address, plain_worker.address, how)))
    flags = [] if how == "own" else tls_args(certs, "client")
    g = launch_gateway(["--config", str(config), *flags])
    try:
        g.wait_ready(num_workers=2)
        pools = httpx.get(f"{g.url}/ready", timeout=5).json()["pools"]
        assert {name: p["workers_healthy"] for name, p in pools.items()} == {"tls": 1, "plain": 1}
        client = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)
        for model in (MODEL, PLAIN):
            answer = client.completions.create(model=model, prompt="Hello", max_tokens=2)
            assert answer.model == model and answer.choices[0].text is not None
    finally:
        g.stop(timeout_s=10)
