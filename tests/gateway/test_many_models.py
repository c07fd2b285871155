"""Many models behind one gateway, end to end: a real `kvflow router` with a `pools:`
config in front of real simulated `kvflow worker` processes (one pool per model version),
driven by the openai client: routing by name and alias, tenants' allowlists on public
names (404/403, /v1/models), a weighted split, sticky sessions, a dead pool's 503, and the
latency histograms and worker gauges split by version and pool."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.models.routes import session_draw
from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

V1, V2 = "smollm2-v1", "smollm2-v2"  # what each pool's workers serve
TENANTS = {"alice": ["smollm2"], "bob": ["*"], "carol": [V2]}
MESSAGES = [{"role": "user", "content": "hello"}]
CANARY_SHARE = 0.3  # of "canary" requests that go to v2 (weights 70/30)
MODEL_REQUESTS = "kvflow_router_model_requests"


def key(name: str) -> str:
    return f"sk-{name}-0123456789"


def router_config(v1: str, v2: str) -> dict[str, object]:
    return {
        "tenants": [
            {"name": n, "api_key_sha256": hash_api_key(key(n)), "models": models,
             "admin": n == "bob"}
            for n, models in TENANTS.items()
        ],
        "pools": [
            {"name": "smollm-v1", "served_model_name": V1, "workers": [v1]},
            {"name": "smollm-v2", "workers": [v2]},  # its name: what its worker reports
            # Nobody listens there: its requests get 503s naming the pool.
            {"name": "dead", "served_model_name": "old-model",
             "workers": [f"127.0.0.1:{free_port()}"]},
        ],
        "models": [
            {"name": "smollm2", "aliases": ["chat"],
             "targets": [{"pool": "smollm-v1", "weight": 95}, {"pool": "smollm-v2", "weight": 5}]},
            {"name": "canary",
             "targets": [{"pool": "smollm-v1", "weight": 70}, {"pool": "smollm-v2", "weight": 30}]},
            # Half its weight on the dead pool: that half goes to the live one instead.
            {"name": "failover",
             "targets": [{"pool": "dead", "weight": 50}, {"pool": "smollm-v1", "weight": 50}]},
        ],
    }  # fmt: skip


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    try:
        for name in (V1, V2):
            started.append(launch_worker(["--simulate", "--served-model-name", name,
                                          "--sim-base-step-ms", "1"], timeout_s=120))  # fmt: skip
        yield started
    finally:
        for w in started:
            w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory, workers: list[WorkerProcess]) -> Path:
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(router_config(workers[0].address, workers[1].address)))
    return path


@pytest.fixture(scope="module")
def gateway(config_path: Path) -> Iterator[GatewayProcess]:
    g = launch_gateway(["--config", str(config_path), "--seed", "0"])
    try:
        g.wait_ready(num_workers=2)
        yield g
    finally:
        g.stop()


def request_log_line(g: GatewayProcess, request_id: str) -> str:
    """The gateway's request log line for ``request_id`` (its output arrives on a thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in g.log.splitlines():
            if f"request_id={request_id} " in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}")


def client(g: GatewayProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=key(tenant), max_retries=0, timeout=30)


def chat(g: GatewayProcess, tenant: str, model: str, **kw: object):  # type: ignore[no-untyped-def]
    return client(g, tenant).chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, **kw
    )


def test_each_name_reaches_its_pool_and_the_response_names_the_version(
    gateway: GatewayProcess,
) -> None:
    assert chat(gateway, "bob", V1).model == V1
    assert chat(gateway, "bob", V2).model == V2  # learned from the pool's worker
    assert chat(gateway, "bob", "chat").model in (V1, V2)  # an alias answers as a version
    stream = client(gateway, "bob").chat.completions.create(
        model=V2, messages=MESSAGES, max_tokens=2, stream=True
    )
    assert {chunk.model for chunk in stream} == {V2}
    raw = client(gateway, "bob").chat.completions.with_raw_response.create(
        model=V2, messages=MESSAGES, max_tokens=2, extra_headers={"x-kvflow-route": "1"}
    )
    assert raw.headers["x-kvflow-route"].startswith("pool=smollm-v2; ")
    assert f"model={V2} pool=smollm-v2 " in request_log_line(gateway, raw.headers["x-request-id"])


def test_tenants_allowlists_match_the_public_name(gateway: GatewayProcess) -> None:
    assert chat(gateway, "alice", "smollm2").model in (V1, V2)
    with pytest.raises(openai.PermissionDeniedError):
        chat(gateway, "alice", "chat")  # the same entry, by a name alice may not use
    with pytest.raises(openai.PermissionDeniedError):
        chat(gateway, "alice", V1)
    with pytest.raises(openai.NotFoundError) as info:
        chat(gateway, "alice", "gpt-4")
    assert "Models served here: smollm2 " in info.value.message  # only alice's names
    with pytest.raises(openai.NotFoundError):
        chat(gateway, "bob", "smollm-v1")  # a pool's name is not a model name
    listed = {t: [m.id for m in client(gateway, t).models.list()] for t in TENANTS}
    assert listed == {
        "alice": ["smollm2"],
        "bob": ["canary", "chat", "failover", "old-model", "smollm2", V1, V2],
        "carol": [V2],
    }
    assert client(gateway, "carol").models.retrieve(V2).id == V2
    with pytest.raises(openai.PermissionDeniedError):
        client(gateway, "carol").models.retrieve("canary")


def test_ready_counts_workers_per_pool_and_a_dead_pool_answers_503(
    gateway: GatewayProcess,
) -> None:
    # Pools (their model names) only to a caller with a key; the counts to anyone.
    anonymous = httpx.get(f"{gateway.url}/ready").json()
    assert anonymous["ready"] and anonymous["workers_healthy"] == 2 and "pools" not in anonymous
    headers = {"authorization": f"Bearer {key('bob')}"}
    ready = httpx.get(f"{gateway.url}/ready", headers=headers).json()
    assert {p: v["workers_healthy"] for p, v in ready["pools"].items()} == {
        "smollm-v1": 1, "smollm-v2": 1, "dead": 0}  # fmt: skip
    with pytest.raises(openai.InternalServerError) as info:
        chat(gateway, "bob", "old-model")
    assert info.value.status_code == 503 and "pool 'dead'" in info.value.message
    assert info.value.response.headers["retry-after"].isdigit()


def test_a_target_pool_without_healthy_workers_gives_its_share_to_the_others(
    gateway: GatewayProcess,
) -> None:
    # Without the failover, about half of these would be 503s naming pool 'dead'.
    answered = [chat(gateway, "bob", "failover").model for _ in range(20)]
    assert answered == [V1] * 20


def test_pool_flags_with_a_pools_config_are_refused(config_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "router", "--config", str(config_path),
         "--served-model-name", "x"], check=False, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--served-model-name cannot be combined with the pools section" in done.stderr


async def _canary_models(g: GatewayProcess, num_requests: int) -> Counter[str]:
    client = openai.AsyncOpenAI(base_url=g.base_url, api_key=key("bob"), max_retries=0)
    gate = asyncio.Semaphore(16)

    async def one() -> str:
        async with gate:
            r = await client.chat.completions.create(
                model="canary", messages=MESSAGES, max_tokens=1
            )
            return r.model

    models = await asyncio.gather(*(one() for _ in range(num_requests)))
    await client.close()
    return Counter(models)


def test_a_weighted_split_sends_each_version_its_share(gateway: GatewayProcess) -> None:
    counts = asyncio.run(_canary_models(gateway, 1000))
    assert set(counts) <= {V1, V2} and sum(counts.values()) == 1000
    # v2's count is Binomial(1000, 0.3): mean 300, sd 14.5. |count - 300| > 72 has
    # probability 6.0e-7 (exact binomial tail, two-sided): a false failure in under one
    # run in a million, while a 75/25 or 65/35 split (or weights ignored) fails.
    assert abs(counts[V2] - 1000 * CANARY_SHARE) <= 72, counts


def scrape(g: GatewayProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The gateway's /metrics: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{g.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def model_count(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], histogram: str,
                model: str) -> float:  # fmt: skip
    # Summed over the other labels (ttft and tpot carry the request's priority_class too).
    return sum(v for (name, labels), v in samples.items()
               if name == f"{histogram}_count" and ("model", model) in labels)  # fmt: skip


def test_latency_is_labelled_by_the_version_that_answered(gateway: GatewayProcess) -> None:
    histograms = ("kvflow_router_ttft_seconds", "kvflow_router_e2e_seconds")
    before = scrape(gateway)
    answered = Counter(chat(gateway, "bob", "canary").model for _ in range(40))
    answered[V2] += 1  # pinned, streamed: the same histograms as a collected answer
    stream = client(gateway, "bob").chat.completions.create(
        model=V2, messages=MESSAGES, max_tokens=2, stream=True
    )
    assert {chunk.model for chunk in stream} == {V2}
    after = scrape(gateway)
    assert answered[V1] > 0 and answered[V2] > 1, answered  # 70/30: both versions answered
    for histogram in histograms:
        got = {m: model_count(after, histogram, m) - model_count(before, histogram, m)
               for m in (V1, V2)}  # fmt: skip
        assert got == {V1: answered[V1], V2: answered[V2]}, histogram
    for histogram in ("kvflow_router_tpot_seconds", "kvflow_router_itl_seconds"):
        assert all(model_count(after, histogram, m) > model_count(before, histogram, m)
                   for m in (V1, V2)), histogram  # fmt: skip


def test_an_unknown_model_name_creates_no_series(gateway: GatewayProcess) -> None:
    for name in ("gpt-4", "smollm-v1"):  # neither is a public name: 404s
        with pytest.raises(openai.NotFoundError):
            chat(gateway, "bob", name)
    answer = chat(gateway, "bob", "chat").model  # an alias: labelled as the version
    samples = scrape(gateway)
    labelled = {dict(labels)["model"] for (name, labels) in samples
                if "model" in dict(labels) and not name.startswith(MODEL_REQUESTS)}  # fmt: skip
    # Nor does old-model: its pool is down, its requests (503) got no latency.
    assert answer in labelled and labelled <= {V1, V2}, labelled
    # Requests are counted per version once a pool was picked: old-model's 503s are (that
    # version is failing), the 404s are not.
    counted = {dict(labels)["model"] for (name, labels) in samples
               if name.startswith(MODEL_REQUESTS)}  # fmt: skip
    assert answer in counted and counted <= {V1, V2, "old-model"}, counted


def test_requests_and_errors_are_counted_per_version(gateway: GatewayProcess) -> None:
    def counts(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> Counter[str]:
        return Counter({f"{dict(labels)['model']} {dict(labels)['code']}": v
                        for (name, labels), v in samples.items()
                        if name == f"{MODEL_REQUESTS}_total"})  # fmt: skip

    before = counts(scrape(gateway))
    answered = Counter(chat(gateway, "bob", "canary").model for _ in range(20))
    with pytest.raises(openai.InternalServerError):
        chat(gateway, "bob", "old-model")  # its pool has no healthy worker: 503
    after = counts(scrape(gateway))
    after.subtract(before)
    expected = {f"{model} 200": n for model, n in answered.items()} | {"old-model 503": 1}
    assert {k: v for k, v in after.items() if v} == expected


def test_worker_gauges_are_per_pool(gateway: GatewayProcess) -> None:
    samples = scrape(gateway)
    for gauge in ("kvflow_router_workers_healthy", "kvflow_router_workers"):
        per_pool = {dict(labels)["pool"]: v for (name, labels), v in samples.items()
                    if name == gauge}  # fmt: skip
        expected_dead = 0.0 if gauge == "kvflow_router_workers_healthy" else 1.0
        assert per_pool == {"smollm-v1": 1.0, "smollm-v2": 1.0, "dead": expected_dead}, gauge


def test_a_session_keeps_its_version(gateway: GatewayProcess) -> None:
    seen: dict[str, set[str]] = {}
    for i in range(20):
        session = f"user-{i}"
        for _ in range(3):
            r = chat(gateway, "bob", "canary", extra_headers={"x-session-id": session})
            seen.setdefault(session, set()).add(r.model)
    for session, models in seen.items():
        # The session's stable draw picks the version: below 0.7 (v1's weight), v1.
        expected = V1 if session_draw(session) < 1 - CANARY_SHARE else V2
        assert models == {expected}, (session, models)
    assert {m for ms in seen.values() for m in ms} == {V1, V2}  # both versions had sessions
