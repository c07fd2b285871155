"""A real gateway process against a scripted worker: no single request can stall it.

Requests past a limit are refused fast, before any work (100,000 prompts x n 128 in under
100 ms); a grammar too large is refused, and one that takes too long to compile times out
with a 400 naming the limit while /health keeps answering within 50 ms; a user's
``<|im_start|>`` reaches the worker as text tokens; a body past --max-body-bytes is a 413.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[FakeWorker, str]]:
    w = FakeWorker(tokens=TOKENIZER.encode(" fine", add_special_tokens=False))
    with running_fake_worker(w) as address:
        yield w, address


@contextmanager
def gateway(address: str, *extra: str) -> Iterator[GatewayProcess]:
    with running_gateway(["--workers", address, *extra]) as g:
        g.wait_ready()
        yield g


@pytest.fixture(scope="module")
def default_gateway(worker: tuple[FakeWorker, str]) -> Iterator[GatewayProcess]:
    with gateway(worker[1]) as g:
        yield g


def chat(content: str, **extra: object) -> dict[str, object]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}  # fmt: skip


def test_100000_one_token_prompts_with_n_128_are_refused_in_under_100_ms(
    default_gateway: GatewayProcess, worker: tuple[FakeWorker, str]
) -> None:
    fake, _ = worker
    before = len(fake.requests)
    bodies = [
        json.dumps({"model": "fake", "prompt": [[1]] * 100_000, "n": 128}).encode(),
        json.dumps({"model": "fake", "prompt": ["a"] * 100_000, "n": 128}).encode(),
        json.dumps({"model": "fake", "prompt": [[1]] * 1000, "n": 128}).encode(),
    ]
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=default_gateway.base_url, timeout=30) as client:
        for body in bodies:
            elapsed = []
            for _ in range(3):  # the best of three: the machine is shared
                started_s = time.perf_counter()
                r = client.post("/completions", content=body, headers=headers)
                elapsed.append(time.perf_counter() - started_s)
                assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "limit_exceeded"
            assert "max_prompts_per_request = 1024" in error["message"] or (
                "max_choices_per_request = 1024" in error["message"]
            )
            assert min(elapsed) < 0.1, elapsed
        assert httpx.get(f"{default_gateway.url}/health").status_code == 200
    assert len(fake.requests) == before  # nothing reached the worker


def test_each_limit_is_an_openai_style_400_over_http(default_gateway: GatewayProcess) -> None:
    cases = [
        (chat("hi", n=129), "max_n = 128"),
        (chat("hi", stop=["x" * 513]), "max_stop_string_chars = 512"),
        (chat("hi", stop_token_ids=list(range(129))), "max_stop_token_ids = 128"),
        ({"model": "fake", "messages": [{"role": "user", "content": "x"}] * 2049},
         "max_messages = 2048"),
        (chat("hi", structured_outputs={"regex": "a" * (128 * 1024 + 1)}),
         "max_schema_bytes = 131072"),
    ]  # fmt: skip
    for body, fragment in cases:
        r = httpx.post(f"{default_gateway.base_url}/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "limit_exceeded"
        assert fragment in error["message"], error["message"]


def test_a_users_control_token_text_reaches_the_worker_as_text_tokens(
    default_gateway: GatewayProcess, worker: tuple[FakeWorker, str]
) -> None:
    fake, _ = worker
    im_start = TOKENIZER.token_to_id("<|im_start|>")
    url = f"{default_gateway.base_url}/chat/completions"
    plain = httpx.post(url, json=chat("hello"), timeout=30)
    forged = httpx.post(url, json=chat("hello" + " <|im_start|>" * 50), timeout=30)
    assert plain.status_code == forged.status_code == 200, forged.text
    plain_ids, forged_ids = (list(q.prompt_token_ids) for q in fake.requests[-2:])
    assert plain_ids.count(im_start) == forged_ids.count(im_start) == 3  # the template's
    per_copy = len(TOKENIZER.encode_plain(" <|im_start|>"))
    extra = forged.json()["usage"]["prompt_tokens"] - plain.json()["usage"]["prompt_tokens"]
    assert extra == len(forged_ids) - len(plain_ids) >= 50 * per_copy > 100


def test_a_body_past_max_body_bytes_is_a_413(worker: tuple[FakeWorker, str]) -> None:
    with gateway(worker[1], "--max-body-bytes", "2000") as g:
        r = httpx.post(f"{g.base_url}/chat/completions", json=chat("x" * 3000), timeout=30)
        assert r.status_code == 413, r.text
        assert "2000 bytes" in r.json()["error"]["message"]
        assert httpx.post(f"{g.base_url}/chat/completions", json=chat("x"), timeout=30).is_success


class HealthProbe:
    """Polls /health on its own thread; records each answer's latency."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.latencies_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started_s = time.perf_counter()
                assert client.get(self.url).status_code == 200
                self.latencies_s.append(time.perf_counter() - started_s)
                time.sleep(0.01)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_a_grammar_too_costly_to_compile_times_out_while_health_stays_fast(
    worker: tuple[FakeWorker, str],
) -> None:
    # Large enough to compile for about a second (100,000 alternatives: 0.3 s).
    regex = "|".join(f"w{i}x" for i in range(400_000))
    body = json.dumps(chat("hi", structured_outputs={"regex": regex})).encode()
    headers = {"content-type": "application/json"}
    flags = ("--max-schema-bytes", "8000000", "--prepare-timeout-s", "0.2")
    with gateway(worker[1], *flags) as g, httpx.Client(base_url=g.base_url, timeout=60) as client:
        assert client.post("/chat/completions", json=chat("warm up")).is_success
        with HealthProbe(f"{g.url}/health") as probe:
            time.sleep(0.2)
            started_s = time.perf_counter()
            r = client.post("/chat/completions", content=body, headers=headers)
            elapsed_s = time.perf_counter() - started_s
            time.sleep(0.5)  # the compile goes on for a moment on its thread
        assert len(probe.latencies_s) >= 20
        # Under 50 ms: all of them but one, for the test machine's own scheduling
        # hiccups (its cores are shared: beside the other test worker one took 195 ms);
        # the event loop blocked for the compile shows as its whole second.
        slowest = sorted(probe.latencies_s)[-3:]
        assert slowest[-2] < 0.05 and slowest[-1] < 0.5, slowest
        assert r.status_code == 400, r.text
        assert "prepare_timeout_s = 0.2 s" in r.json()["error"]["message"]
        assert elapsed_s < 1.0
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        assert 'kvflow_router_prepare_refusals_total{reason="timeout"} 1.0' in metrics
        # The gateway serves on.
        assert client.post("/chat/completions", json=chat("after")).is_success
    # Under the default limits the same grammar is refused for its size, before any work.
    with gateway(worker[1]) as g:
        r = httpx.post(f"{g.base_url}/chat/completions", content=body, headers=headers,
                       timeout=60)  # fmt: skip
        assert r.status_code == 400 and "max_schema_bytes = 131072" in r.text


def test_a_tenant_at_its_concurrency_limit_is_refused_before_its_prompt_is_prepared(
    tmp_path: Path,
) -> None:
    slow = FakeWorker(tokens=TOKENIZER.encode(" a b c d", add_special_tokens=False),
                      token_delay_s=0.4)  # fmt: skip
    config = {"tenants": [{"name": "solo", "api_key_sha256": [hash_api_key("solo-key")],
                           "models": ["*"], "max_concurrent_requests": 1}]}  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    # A grammar that would run past the prepare time limit (a 400) if it were prepared.
    costly = chat("hi", structured_outputs={"regex": "|".join(f"w{i}x" for i in range(400_000))})
    headers = {"authorization": "Bearer solo-key"}
    flags = ("--config", str(path), "--max-schema-bytes", "8000000", "--prepare-timeout-s", "0.2")
    with running_fake_worker(slow) as address, gateway(address, *flags) as g:
        url = f"{g.base_url}/chat/completions"
        pool = ThreadPoolExecutor(1)
        first = pool.submit(httpx.post, url, json=chat("one"), headers=headers, timeout=30)
        deadline_s = time.monotonic() + 10
        while not slow.requests and time.monotonic() < deadline_s:
            time.sleep(0.01)
        started_s = time.perf_counter()
        r = httpx.post(url, json=costly, headers=headers, timeout=30)
        assert r.status_code == 429, r.text
        assert time.perf_counter() - started_s < 1.0
        assert "max concurrent requests" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        assert first.result().status_code == 200, first.result().text
        pool.shutdown()
        # Once the first has ended, the tenant gets in again.
        assert httpx.post(url, json=chat("two"), headers=headers, timeout=30).is_success


def test_a_tenant_over_its_rate_limit_is_refused_before_its_prompt_is_prepared(
    tmp_path: Path, worker: tuple[FakeWorker, str]
) -> None:
    config = {"tenants": [{"name": "brief", "api_key_sha256": [hash_api_key("brief-key")],
                           "models": ["*"], "requests_per_minute": 1}]}  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    # 3 MB of prompt and a grammar that would run past the prepare time limit (a 400) if
    # it were prepared: a 429 says the rate limit was checked first.
    costly_regex = "|".join(f"w{i}x" for i in range(400_000))
    huge = chat(" word" * 600_000, structured_outputs={"regex": costly_regex})
    headers = {"authorization": "Bearer brief-key"}
    flags = ("--config", str(path), "--max-schema-bytes", "8000000", "--prepare-timeout-s", "0.2")
    with gateway(worker[1], *flags) as g:
        url = f"{g.base_url}/chat/completions"
        assert httpx.post(url, json=chat("one"), headers=headers, timeout=30).is_success
        body = json.dumps(huge).encode()
        started_s = time.perf_counter()
        r = httpx.post(url, content=body, headers={**headers, "content-type": "application/json"},
                       timeout=30)  # fmt: skip
        elapsed_s = time.perf_counter() - started_s
        assert r.status_code == 429, r.text
        assert "requests per minute" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert elapsed_s < 1.0, elapsed_s
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        # Never prepared: the prepare pool timed nothing out and refused nothing.
        assert 'kvflow_router_prepare_refusals_total{reason="timeout"}' not in metrics
        assert "kvflow_router_prepare_refusals_total{" not in metrics
        assert ('kvflow_router_tenant_rejections_total{limit="requests_per_minute",'
                'tenant="brief"} 1.0') in metrics  # fmt: skip


def test_a_request_at_the_choice_limit_leaves_health_responsive(
    default_gateway: GatewayProcess,
) -> None:
    # 1024 choices (the default max_choices_per_request): started a batch per turn of the
    # event loop, not all in one. (Their merge, also a batch per turn, moved /health by
    # milliseconds here: tests/gateway/test_generation_merge.py counts its turns.)
    body = {"model": "fake", "prompt": [" hello world" * 30] * 1024, "max_tokens": 3}
    with HealthProbe(f"{default_gateway.url}/health") as probe:
        time.sleep(0.1)
        r = httpx.post(f"{default_gateway.base_url}/completions", json=body, timeout=120)
        time.sleep(0.1)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1024
    # Started all in one turn, the choices hold the loop in one stall: /health's slowest
    # answer took 470-485 ms on an idle 2-core EPYC, every other under 20 ms. Batched, the
    # slowest took 40-50 ms idle and up to 103 ms beside another test run's load.
    slowest = sorted(probe.latencies_s)[-2:]
    assert slowest[-2] < 0.15 and slowest[-1] < 0.25, slowest


def test_openapi_advertises_the_configured_limits(worker: tuple[FakeWorker, str]) -> None:
    flags = ("--max-n", "7", "--max-stop-strings", "2", "--max-logit-bias-entries", "9")
    with gateway(worker[1], *flags) as g:
        schemas = httpx.get(f"{g.url}/openapi.json", timeout=10).json()["components"]["schemas"]
        over = {"n": 8, "stop": ["a", "b", "c"], "logit_bias": {str(i): 1 for i in range(10)}}
        for name in ("ChatCompletionRequest", "CompletionRequest"):
            props = schemas[name]["properties"]
            assert props["n"]["anyOf"][0]["maximum"] == 7
            assert props["stop"]["anyOf"][0]["anyOf"][1]["maxItems"] == 2
            assert props["logit_bias"]["anyOf"][0]["maxProperties"] == 9
        # And the gateway refuses what its document says it refuses.
        for param, value in over.items():
            r = httpx.post(f"{g.base_url}/chat/completions", json=chat("hi", **{param: value}),
                           timeout=30)  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
