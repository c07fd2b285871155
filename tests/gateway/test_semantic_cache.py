"""The semantic cache end to end: a real `kvflow worker --task embed` embeds, a fake worker
generates, a real router with a real redis-server keeps the entries, the official `openai`
client asks. A paraphrase gets the stored answer (streamed and not), a near-miss does not,
another tenant never does, a model change invalidates, an opt-out and a tenant that has not
opted in bypass it."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import running_redis
from testkit.worker_process import running_worker

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKENIZER = load_text_model(None).tokenizer
EMBED = "wordllama-l2-supercat"
KEYS = {"a": "sk-scache-tenant-a-0123", "b": "sk-scache-tenant-b-0123",
        "c": "sk-scache-tenant-c-0123", "ops": "sk-scache-tenant-ops-01"}  # fmt: skip
HEADER = "x-kvflow-semantic-cache"
# Paraphrases above the default threshold (0.97) under the real model, and a near-miss
# far below it (bench/data/semantic_cache_pairs.json has both).
QUESTION = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"
NEAR_MISS_STORED = "How do I enable two-factor authentication?"
NEAR_MISS = "How do I disable two-factor authentication?"


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@dataclass
class Cluster:
    worker: FakeWorker
    gateway: GatewayProcess

    def client(self, tenant: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateway.base_url, api_key=KEYS[tenant],
                             max_retries=0, timeout=30)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    worker = FakeWorker(tokens=tokens(" first answer"))
    with (
        running_worker(["--task", "embed"]) as embedder,
        running_redis() as redis,
        running_fake_worker(worker) as address,
    ):
        config = {
            "pools": [
                {"name": "embed", "served_model_name": EMBED, "workers": [embedder.address]},
                {"name": "gen", "served_model_name": "fake", "workers": [address]},
            ],
            "tenants": [
                {"name": "a", "api_key_sha256": hash_api_key(KEYS["a"]), "semantic_cache": True},
                {"name": "b", "api_key_sha256": hash_api_key(KEYS["b"]), "semantic_cache": True},
                {"name": "c", "api_key_sha256": hash_api_key(KEYS["c"])},
                {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
            ],
            "semantic_cache": {"embedding_model": EMBED, "models": {"fake": {}}},
        }
        path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        g = launch_gateway(["--config", str(path), "--redis-url", redis.url])
        try:
            g.wait_ready(num_workers=2)
            yield Cluster(worker, g)
        finally:
            g.stop()


def ask(
    cluster: Cluster, content: str, tenant: str = "a", headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[str, str | None]:  # fmt: skip
    """(the answer's text, the semantic cache's header)"""
    body = {"temperature": 0, "max_tokens": 8, **extra}
    raw = cluster.client(tenant).chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": content}], extra_headers=headers,
        **body,
    )  # fmt: skip
    return raw.parse().choices[0].message.content or "", raw.headers.get(HEADER)


def usage_of(cluster: Cluster, content: str, headers: dict[str, str] | None = None) -> Any:
    return cluster.client().chat.completions.create(
        model="fake", messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=8, extra_headers=headers,
    ).usage  # fmt: skip


def ask_streamed(cluster: Cluster, content: str) -> tuple[str, str | None]:
    raw = cluster.client().chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=8, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    return text, raw.headers.get(HEADER)


def similarity(header: str | None) -> float:
    found = re.fullmatch(r"hit; similarity=(\d\.\d\d)", header or "")
    assert found is not None, header
    return float(found.group(1))


def test_a_paraphrase_hits_streamed_and_not_and_a_near_miss_misses(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" reset it in settings")
    assert ask(cluster, QUESTION) == (" reset it in settings", "miss")
    cluster.worker.tokens = tokens(" something else")
    sent = len(cluster.worker.requests)
    text, header = ask(cluster, PARAPHRASE)
    assert text == " reset it in settings" and 0.97 <= similarity(header) <= 1.0
    text, header = ask_streamed(cluster, PARAPHRASE)
    assert text == " reset it in settings" and similarity(header) >= 0.97
    assert len(cluster.worker.requests) == sent  # both answered without the model
    # A hit bills its own prompt (all of it cached), not the stored question's.
    stored = usage_of(cluster, "What are your opening hours?")
    hit = usage_of(cluster, "What are your hours of opening?")
    live = usage_of(cluster, "What are your hours of opening?", {"x-kvflow-cache": "off"})
    assert hit.prompt_tokens == live.prompt_tokens != stored.prompt_tokens
    assert hit.prompt_tokens_details.cached_tokens == hit.prompt_tokens
    assert live.prompt_tokens_details.cached_tokens == 0

    cluster.worker.tokens = tokens(" enable it")
    assert ask(cluster, NEAR_MISS_STORED) == (" enable it", "miss")
    cluster.worker.tokens = tokens(" disable it")
    assert ask(cluster, NEAR_MISS) == (" disable it", "miss")


def test_another_tenant_never_gets_the_answer(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" tenant a's answer")
    question = "What is the tallest mountain in the world?"
    assert ask(cluster, question, "a") == (" tenant a's answer", "miss")
    cluster.worker.tokens = tokens(" tenant b's answer")
    # The same text, and a paraphrase: tenant b only ever gets its own.
    assert ask(cluster, question, "b") == (" tenant b's answer", "miss")
    assert ask(cluster, "Which mountain is the tallest in the world?", "b")[0] == (
        " tenant b's answer"
    )
    assert ask(cluster, question, "a")[0] == " tenant a's answer"


def test_opt_outs_bypass(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" stored")
    question = "How do I cancel my subscription?"
    assert ask(cluster, question) == (" stored", "miss")
    cluster.worker.tokens = tokens(" fresh")
    paraphrase = "How can I cancel my subscription?"
    for headers in ({"x-kvflow-cache": "off"}, {"cache-control": "no-store"}):
        assert ask(cluster, paraphrase, headers=headers) == (" fresh", "bypass")
    assert ask(cluster, paraphrase, temperature=0.7) == (" fresh", "bypass")
    assert ask(cluster, paraphrase, "c") == (" fresh", "bypass")  # not opted in
    assert ask(cluster, paraphrase)[0] == " stored"  # none of them stored its answer


def test_a_model_change_invalidates(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" old model")
    assert ask(cluster, "How do I install numpy?") == (" old model", "miss")
    assert ask(cluster, "How can I install numpy?")[0] == " old model"
    cluster.worker.tokens = tokens(" new model")
    cluster.worker.model_revision = "v2"  # another model identity behind the same name
    deadline_s = time.monotonic() + 20
    while (answer := ask(cluster, "How can I install numpy?"))[0] == " old model":
        assert time.monotonic() < deadline_s, "the old model's answer kept matching"
        time.sleep(0.2)
    assert answer == (" new model", "miss")


def test_an_admin_purge_drops_a_tenants_near_answers(cluster: Cluster) -> None:
    question, paraphrase = "How do I delete my account?", "How can I delete my account?"
    cluster.worker.tokens = tokens(" before the purge")
    for tenant in ("a", "b"):
        assert ask(cluster, question, tenant) == (" before the purge", "miss")
    purged = httpx.post(f"{cluster.gateway.base_url}/response_cache/purge",
                        json={"pool": "gen", "tenant": "a"},
                        headers={"authorization": f"Bearer {KEYS['ops']}"})  # fmt: skip
    assert purged.status_code == 200 and purged.json()["deleted"] >= 1
    cluster.worker.tokens = tokens(" after the purge")
    assert ask(cluster, paraphrase, "a") == (" after the purge", "miss")
    assert ask(cluster, paraphrase, "b")[0] == " before the purge"
