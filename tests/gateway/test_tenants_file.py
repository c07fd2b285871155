"""Tenants from a file a running gateway re-reads (a mounted Secret on Kubernetes), with an
HMAC key digest under a server-side secret: real gateway processes, a real simulated
worker and the official `openai` client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from testkit.gateway_process import launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.tenants.config import hash_api_key, hmac_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SECRET = "the-gateways-hmac-secret"
RELOAD_S = 5.0  # tenants/source.py, RELOAD_INTERVAL_S


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--simulate", "--served-model-name", MODEL], timeout_s=120)
    yield w
    w.stop(timeout_s=10)


def ask(base_url: str, api_key: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=30)
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    return reply.choices[0].text


def test_a_rotated_key_works_without_a_restart(worker: WorkerProcess, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    hmac_digest = hmac_api_key("sk-alpha-0123456789", SECRET.encode())
    tenants.write_text(f"- {{name: alpha, api_key_hmac_sha256: [{hmac_digest}]}}\n")
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--tenants-file", str(tenants)],
                       env={"KVFLOW_TENANT_KEY_SECRET": SECRET})  # fmt: skip
    try:
        g.wait_ready(num_workers=1)
        assert ask(g.base_url, "sk-alpha-0123456789")
        for wrong in ("sk-beta-0123456789", hmac_digest, SECRET):
            with pytest.raises(openai.AuthenticationError):
                ask(g.base_url, wrong)
        # Rotate: alpha's key goes, beta's (a plain SHA-256 digest) comes, by rename as the
        # kubelet swaps a Secret's files.
        staged = tmp_path / "staged.yaml"
        beta = hash_api_key("sk-beta-0123456789")
        staged.write_text(f"- {{name: beta, api_key_sha256: [{beta}]}}\n")
        staged.replace(tenants)
        deadline = time.monotonic() + RELOAD_S + 10
        while True:
            try:
                ask(g.base_url, "sk-beta-0123456789")
                break
            except openai.AuthenticationError:
                assert time.monotonic() < deadline, "the new key never took effect"
                time.sleep(0.5)
        with pytest.raises(openai.AuthenticationError):
            ask(g.base_url, "sk-alpha-0123456789")
        # A broken file keeps beta: a typo must not lock everyone out.
        tenants.write_text("- {name: beta, api_key_sha256: [not-a-digest]}\n")
        time.sleep(RELOAD_S + 1)
        assert ask(g.base_url, "sk-beta-0123456789")
        assert "keeping the tenants in force" in g.log
    finally:
        g.stop()


def test_start_fails_clearly_on_tenants_it_cannot_serve(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"- {{name: a, api_key_hmac_sha256: [{'ab' * 32}]}}\n")
    cases = [
        (["--tenants-file", str(tenants)], "KVFLOW_TENANT_KEY_SECRET"),  # no secret in env
        (["--tenants-file", str(tmp_path / "missing.yaml")], "cannot read the tenants file"),
    ]
    for args, fragment in cases:
        done = subprocess.run(
            [sys.executable, "-m", "kvflow.cli.main", "router", "--workers", "127.0.0.1:1",
             *args],
            check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert fragment in done.stderr and "Traceback" not in done.stderr


def test_hash_api_key_prints_the_hmac_digest_with_the_secret_set() -> None:
    def digest(env: dict[str, str]) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "kvflow.cli.main", "router", "--hash-api-key"],
            input="sk-key\n", check=False, capture_output=True, text=True, timeout=60,
            env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    base = {k: v for k, v in os.environ.items() if k != "KVFLOW_TENANT_KEY_SECRET"}
    assert digest(base) == hash_api_key("sk-key")
    assert digest({**base, "KVFLOW_TENANT_KEY_SECRET": SECRET}) == hmac_api_key(
        "sk-key", SECRET.encode()
    )
