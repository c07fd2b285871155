"""Stored responses per tenant (`/v1/responses`), through the official `openai` client
against a real gateway and the built-in SmolLM2-135M-Instruct worker: a tenant needs its key,
is charged, sees only its own responses, and cannot push another's out of the gateway's
memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testkit.gateway_process import launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--served-model-name", MODEL, "--num-kv-blocks", "256"], timeout_s=300)
    yield w
    w.stop(timeout_s=10)


def tenants_file(folder: Path, **keys: str) -> Path:
    """A tenants file of one tenant per name, each with its API key."""
    path = folder / "tenants.yaml"
    people = [{"name": name, "api_key_sha256": hash_api_key(key)} for name, key in keys.items()]
    path.write_text(yaml.safe_dump(people))
    return path


def test_a_tenant_needs_its_key_is_charged_and_sees_only_its_own_responses(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    key, other = "sk-alice-responses", "sk-bob-responses"
    tenants = tenants_file(tmp_path, alice=key, bob=other)
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--tenants-file", str(tenants)])  # fmt: skip
    try:
        g.wait_ready()
        anonymous = httpx.post(f"{g.url}/v1/responses", json={"model": MODEL, "input": "hi"})
        assert anonymous.status_code == 401, anonymous.text
        alice = openai.OpenAI(base_url=g.base_url, api_key=key, max_retries=0, timeout=300)
        response = alice.responses.create(model=MODEL, input=QUESTION, max_output_tokens=5)
        assert response.usage is not None
        usage = httpx.get(f"{g.url}/v1/usage", headers={"authorization": f"Bearer {key}"}).json()
        assert usage["tenant"] == "alice" and usage["requests"] == 1
        assert usage["completion_tokens"] == response.usage.output_tokens
        bob = openai.OpenAI(base_url=g.base_url, api_key=other, max_retries=0, timeout=300)
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model=MODEL, input="x", previous_response_id=response.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            bob.responses.input_items.list(response.id)
        assert len(alice.responses.input_items.list(response.id).data) == 1
        assert alice.responses.retrieve(response.id).id == response.id
    finally:
        g.stop()


def test_one_tenants_responses_do_not_push_out_anothers_from_memory(
    worker: WorkerProcess, tmp_path: Path
) -> None:
    """Past --responses-max-memory-bytes the tenant holding the most gives up its oldest:
    bob storing many responses pushes out his own, never alice's one (before, one LRU
    across tenants dropped hers first)."""
    key, other = "sk-alice-memory", "sk-bob-memory"
    tenants = tenants_file(tmp_path, alice=key, bob=other)
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--tenants-file", str(tenants),
                        "--responses-max-memory-bytes", "16384"])  # fmt: skip
    try:
        g.wait_ready()
        alice = openai.OpenAI(base_url=g.base_url, api_key=key, max_retries=0, timeout=300)
        bob = openai.OpenAI(base_url=g.base_url, api_key=other, max_retries=0, timeout=300)
        hers = alice.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
        his = [bob.responses.create(model=MODEL, input=f"{i} " + "word " * 300,
                                    max_output_tokens=2) for i in range(12)]  # fmt: skip
        assert all(r.store for r in his)
        assert alice.responses.retrieve(hers.id).id == hers.id
        with pytest.raises(openai.NotFoundError):
            bob.responses.retrieve(his[0].id)  # his oldest made room
        assert bob.responses.retrieve(his[-1].id).id == his[-1].id
    finally:
        g.stop()
