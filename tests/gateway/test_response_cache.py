"""The response cache end to end: two gateway processes share it through one redis-server,
the official `openai` client gets hits streamed and not, each tenant only its own answers;
a model that changes, an opt-out, a sampled request never get a stored answer; a hit bills
its prompt as cached input and no completion."""

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

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer
KEYS = {"a": "sk-rcache-tenant-a-0123", "b": "sk-rcache-tenant-b-0123",
        "c": "sk-rcache-tenant-c-0123", "ops": "sk-rcache-tenant-ops-01"}  # fmt: skip
# Per million tokens: 1 USD an input token, 0.001 a cached one, 10 an output token.
PRICES = {"input_usd_per_million_tokens": 1_000_000,
          "cached_input_usd_per_million_tokens": 1_000,
          "output_usd_per_million_tokens": 10_000_000}  # fmt: skip
CACHED_PUSD_PER_TOKEN = 10**9


def tokens(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@dataclass
class Cluster:
    worker: FakeWorker
    gateways: list[GatewayProcess]

    def client(self, i: int, tenant: str = "a") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[i].base_url, api_key=KEYS[tenant],
                             max_retries=0, timeout=30)  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = {
        "tenants": [
            {"name": "a", "api_key_sha256": hash_api_key(KEYS["a"])},
            {"name": "b", "api_key_sha256": hash_api_key(KEYS["b"])},
            {"name": "c", "api_key_sha256": hash_api_key(KEYS["c"]), "response_cache": False},
            {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
        ],
        "prices": {"fake": PRICES},
    }
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    worker = FakeWorker(tokens=tokens(" first answer"))
    with running_redis() as redis, running_fake_worker(worker) as address:
        started: list[GatewayProcess] = []
        try:
            args = ["--workers", address, "--config", str(path), "--redis-url", redis.url,
                    "--response-cache", "on", "--response-cache-ttl-s", "600"]  # fmt: skip
            for _ in range(2):
                g = launch_gateway(args)
                started.append(g)
                g.wait_ready()
            yield Cluster(worker, started)
        finally:
            for g in started:
                g.stop()


def ask(client: openai.OpenAI, content: str, headers: dict[str, str] | None = None,
        **extra: Any) -> tuple[str, str | None, Any]:  # fmt: skip
    """(the answer's text, the cache header, usage)"""
    body = {"temperature": 0, "max_tokens": 8, **extra}
    raw = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": content}],
        extra_headers=headers, **body,
    )  # fmt: skip
    reply = raw.parse()
    return reply.choices[0].message.content, raw.headers.get("x-kvflow-response-cache"), reply.usage


def ask_streamed(client: openai.OpenAI, content: str, headers: dict[str, str] | None = None
                 ) -> tuple[list[tuple[Any, ...]], str | None, Any]:  # fmt: skip
    """(each chunk's role, content and finish reason; the cache header; the usage chunk's)"""
    raw = client.chat.completions.with_raw_response.create(
        model="fake", messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=8, stream=True, stream_options={"include_usage": True},
        extra_headers=headers,
    )  # fmt: skip
    shape, usage = [], None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            shape.append((choice.index, choice.delta.role, choice.delta.content,
                          choice.finish_reason))  # fmt: skip
    return shape, raw.headers.get("x-kvflow-response-cache"), usage


def text_of(shape: list[tuple[Any, ...]]) -> str:
    return "".join(content or "" for _, _, content, _ in shape)


def unique(label: str) -> str:
    return f"{label} {time.time_ns()}"


def test_a_hit_is_shared_by_replicas_streamed_and_not(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" shared answer")
    prompt = unique("shared")
    sent = len(cluster.worker.requests)
    text, result, usage = ask(cluster.client(0), prompt)
    assert (text, result) == (" shared answer", "miss")
    assert usage.prompt_tokens_details.cached_tokens == 0
    # The other replica answers from Redis: the worker sees nothing more.
    cluster.worker.tokens = tokens(" something else")
    again, result, hit_usage = ask(cluster.client(1), prompt)
    assert (again, result) == (" shared answer", "hit")
    assert len(cluster.worker.requests) == sent + 1
    assert hit_usage.prompt_tokens == usage.prompt_tokens
    assert hit_usage.completion_tokens == usage.completion_tokens
    assert hit_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens
    # Streamed: the stored answer, as a live stream of it would come.
    shape, result, stream_usage = ask_streamed(cluster.client(0), prompt)
    assert result == "hit" and text_of(shape) == " shared answer"
    assert len(cluster.worker.requests) == sent + 1
    assert stream_usage.prompt_tokens_details.cached_tokens == stream_usage.prompt_tokens
    assert stream_usage.completion_tokens == usage.completion_tokens
    cluster.worker.tokens = tokens(" shared answer")
    live, result, _ = ask_streamed(cluster.client(0), prompt, {"x-kvflow-cache": "off"})
    assert result == "bypass" and len(cluster.worker.requests) == sent + 2
    assert shape == live  # role chunk, the same content chunks, the finish chunk
    assert shape[0][1] == "assistant" and shape[-1][3] == "length"


def test_a_streamed_miss_is_stored_once_complete(cluster: Cluster) -> None:
    cluster.worker.tokens = tokens(" streamed answer")
    prompt = unique("streamed")
    shape, result, _ = ask_streamed(cluster.client(1), prompt)
    assert result == "miss" and text_of(shape) == " streamed answer"
    cluster.worker.tokens = tokens(" something else")
    assert ask(cluster.client(0), prompt)[:2] == (" streamed answer", "hit")


def test_a_tenant_never_gets_another_tenants_answer(cluster: Cluster) -> None:
    prompt = unique("tenants")
    cluster.worker.tokens = tokens(" for tenant a")
    assert ask(cluster.client(0, "a"), prompt)[:2] == (" for tenant a", "miss")
    cluster.worker.tokens = tokens(" for tenant b")
    assert ask(cluster.client(1, "b"), prompt)[:2] == (" for tenant b", "miss")
    assert ask(cluster.client(0, "b"), prompt)[:2] == (" for tenant b", "hit")
    assert ask(cluster.client(1, "a"), prompt)[:2] == (" for tenant a", "hit")
    # The same tenant's users with different prompt_cache_keys keep theirs apart too.
    cluster.worker.tokens = tokens(" for user u1")
    result = ask(cluster.client(0, "a"), prompt, extra_body={"prompt_cache_key": "u1"})
    assert result[:2] == (" for user u1", "miss")


def test_opt_outs_and_sampled_requests_bypass(cluster: Cluster) -> None:
    prompt = unique("opt-out")
    cluster.worker.tokens = tokens(" stored")
    assert ask(cluster.client(0), prompt)[1] == "miss"
    cluster.worker.tokens = tokens(" fresh")
    for headers in ({"x-kvflow-cache": "off"}, {"cache-control": "no-store"}):
        assert ask(cluster.client(1), prompt, headers)[:2] == (" fresh", "bypass")
    assert ask(cluster.client(1), prompt, temperature=0.7)[:2] == (" fresh", "bypass")
    assert ask(cluster.client(1), prompt, n=2)[:2] == (" fresh", "bypass")
    # Seeded, a sampled request is deterministic: cached.
    assert ask(cluster.client(1), prompt, temperature=0.7, seed=5)[1] == "miss"
    assert ask(cluster.client(0), prompt, temperature=0.7, seed=5)[:2] == (" fresh", "hit")
    # The tenant whose config turns it off.
    assert ask(cluster.client(0, "c"), prompt)[:2] == (" fresh", "bypass")
    assert ask(cluster.client(0, "c"), prompt)[:2] == (" fresh", "bypass")
    # no-cache: the stored answer is replaced by a fresh one.
    assert ask(cluster.client(0), prompt)[:2] == (" stored", "hit")
    assert ask(cluster.client(0), prompt, {"cache-control": "no-cache"})[:2] == (" fresh", "miss")
    assert ask(cluster.client(1), prompt)[:2] == (" fresh", "hit")


def test_a_model_change_invalidates(cluster: Cluster) -> None:
    prompt = unique("model-change")
    cluster.worker.tokens = tokens(" old model")
    assert ask(cluster.client(0), prompt)[:2] == (" old model", "miss")
    assert ask(cluster.client(1), prompt)[:2] == (" old model", "hit")
    # The pool's workers now report another model identity (a new revision behind the
    # same name); both gateways see it at their next health probe.
    cluster.worker.tokens = tokens(" new model")
    # Left at v2: both gateways know it once this test passes, and a later flip back would
    # change the key under the tests that follow.
    cluster.worker.model_revision = "v2"
    for i in range(2):  # the old answer, until the gateway knows; then never again
        deadline_s = time.monotonic() + 20
        while (answer := ask(cluster.client(i), prompt))[0] == " old model":
            assert answer[1] == "hit"
            assert time.monotonic() < deadline_s, "the old model's answer kept matching"
            time.sleep(0.2)
        assert answer[0] == " new model"
    for i in range(2):
        assert ask(cluster.client(i), prompt)[:2] == (" new model", "hit")


def _purge(g: GatewayProcess, tenant: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{g.base_url}/response_cache/purge", json=body,
                      headers={"authorization": f"Bearer {KEYS[tenant]}"})  # fmt: skip


def test_an_admin_purges_a_tenants_answers_everywhere(cluster: Cluster) -> None:
    prompt = unique("purge")
    cluster.worker.tokens = tokens(" before the purge")
    for tenant in ("a", "b"):
        assert ask(cluster.client(0, tenant), prompt)[1] == "miss"
    refused = _purge(cluster.gateways[1], "a", {"tenant": "a"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"
    for bad in ({"pool": "nope"}, {"tenant": "a*"}, {"other": 1}, []):
        assert _purge(cluster.gateways[1], "ops", bad).status_code == 400, bad  # type: ignore[arg-type]
    purged = _purge(cluster.gateways[1], "ops", {"tenant": "a"})
    assert purged.status_code == 200 and purged.json()["deleted"] >= 1
    cluster.worker.tokens = tokens(" after the purge")
    assert ask(cluster.client(0, "a"), prompt)[:2] == (" after the purge", "miss")
    assert ask(cluster.client(0, "b"), prompt)[:2] == (" before the purge", "hit")
    assert _purge(cluster.gateways[0], "ops", {"pool": "default"}).json()["deleted"] >= 2
    assert ask(cluster.client(1, "b"), prompt)[:2] == (" after the purge", "miss")


def _usage(g: GatewayProcess, tenant: str) -> dict[str, int]:
    answer = httpx.get(f"{g.base_url}/usage", headers={"authorization": f"Bearer {KEYS[tenant]}"})
    usage: dict[str, int] = answer.json()
    return usage


def _e2e_count(g: GatewayProcess) -> float:
    text = httpx.get(f"{g.url}/metrics").text
    match = re.search(
        r'^kvflow_router_e2e_seconds_count\{model="fake"\} (\S+)$', text, re.MULTILINE
    )
    return 0.0 if match is None else float(match.group(1))


def test_a_hit_bills_cached_input_and_no_completion(cluster: Cluster) -> None:
    prompt = unique("billing")
    cluster.worker.tokens = tokens(" billed")
    assert ask(cluster.client(0, "b"), prompt)[1] == "miss"
    before = _usage(cluster.gateways[0], "b")
    e2e_before = _e2e_count(cluster.gateways[1])
    _, result, usage = ask(cluster.client(1, "b"), prompt)
    assert result == "hit" and usage.completion_tokens > 0
    after = _usage(cluster.gateways[0], "b")
    # The model's latency histograms stay the model's.
    assert _e2e_count(cluster.gateways[1]) == e2e_before
    delta = {k: after[k] - before[k] for k in ("requests", "prompt_tokens", "completion_tokens",
                                               "cached_tokens", "spend_pusd")}  # fmt: skip
    p = usage.prompt_tokens
    assert delta == {"requests": 1, "prompt_tokens": p, "completion_tokens": 0,
                     "cached_tokens": p, "spend_pusd": p * CACHED_PUSD_PER_TOKEN}  # fmt: skip


def test_metrics_count_what_the_cache_did(cluster: Cluster) -> None:
    prompt = unique("metrics")
    assert ask(cluster.client(1), prompt)[1] == "miss"
    assert ask(cluster.client(1), prompt)[1] == "hit"
    assert ask(cluster.client(1), prompt, temperature=1)[1] == "bypass"
    text = httpx.get(f"{cluster.gateways[1].url}/metrics").text
    for name in ('lookups_total{result="hit"}', 'lookups_total{result="miss"}',
                 'lookups_total{result="bypass"}', "stores_total", "stored_bytes_total",
                 'bypasses_total{reason="temperature"}'):  # fmt: skip
        pattern = "^" + re.escape(f"kvflow_router_response_cache_{name}") + r" (\S+)$"
        match = re.search(pattern, text, re.MULTILINE)
        assert match is not None and float(match.group(1)) > 0, name


@pytest.fixture(scope="module")
def alone() -> Iterator[tuple[FakeWorker, GatewayProcess]]:
    """One gateway without Redis: the in-process store."""
    worker = FakeWorker(tokens=tokens(" alone"))
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--workers", address, "--response-cache", "on",
                            "--response-cache-max-entry-kib", "1"])  # fmt: skip
        try:
            g.wait_ready()
            yield worker, g
        finally:
            g.stop()


def _client(g: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)


def test_without_redis_the_gateway_keeps_answers_in_process(alone) -> None:
    worker, g = alone
    prompt = unique("in-process")
    worker.tokens = tokens(" kept here")
    assert ask(_client(g), prompt)[:2] == (" kept here", "miss")
    worker.tokens = tokens(" other")
    assert ask(_client(g), prompt)[:2] == (" kept here", "hit")
    text = httpx.get(f"{g.url}/metrics").text
    assert re.search(r"^kvflow_router_response_cache_bytes [1-9]", text, re.MULTILINE), text


def test_off_by_default_every_request_reaches_the_model() -> None:
    worker = FakeWorker(tokens=tokens(" live"))
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--workers", address])
        try:
            g.wait_ready()
            for _ in range(2):
                raw = _client(g).chat.completions.with_raw_response.create(
                    model="fake", messages=[{"role": "user", "content": "same"}], temperature=0
                )
                assert "x-kvflow-response-cache" not in raw.headers
            assert len(worker.requests) == 2
        finally:
            g.stop()


def test_errors_disconnects_and_large_answers_are_not_stored(alone) -> None:
    worker, g = alone
    prompt = unique("unfinished")
    # A worker dying mid-stream: an error event, nothing stored.
    worker.tokens, worker.mode, worker.die_after = tokens(" a b c d e f"), "die", 2
    try:
        with pytest.raises(openai.APIError):
            ask_streamed(_client(g), prompt)
    finally:
        worker.mode = "ok"
    # A client that leaves mid-stream: the answer is cut short, nothing stored.
    worker.token_delay_s = 0.2  # the whole answer takes 1.2 s: the hang-up comes first
    try:
        body = {"model": "fake", "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 8, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{g.base_url}/chat/completions", json=body) as answer:
            assert answer.headers["x-kvflow-response-cache"] == "miss"
            next(answer.iter_lines())  # the role chunk; then hang up
    finally:
        worker.token_delay_s = 0.0
    time.sleep(0.5)
    worker.tokens = tokens(" complete")
    assert ask(_client(g), prompt)[:2] == (" complete", "miss")
    assert ask(_client(g), prompt)[:2] == (" complete", "hit")
    # Past --response-cache-max-entry-kib: answered, not stored.
    big = unique("big")
    worker.tokens = tokens(" word" * 300)
    assert ask(_client(g), big, max_tokens=400)[1] == "miss"
    assert ask(_client(g), big, max_tokens=400)[1] == "miss"
    text = httpx.get(f"{g.url}/metrics").text
    for reason in ("unfinished", "too_large"):
        pattern = rf'^kvflow_router_response_cache_skipped_stores_total{{reason="{reason}"}} (\S+)$'
        match = re.search(pattern, text, re.MULTILINE)
        assert match is not None and float(match.group(1)) >= 1, reason
