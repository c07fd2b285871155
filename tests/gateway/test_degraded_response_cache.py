"""The response_cache degradation step end to end: a real `kvflow router` process with its
response cache on, in front of a scripted gRPC worker whose speed the test sets. A greedy
request stores its answer; slow answers take the model's ladder to response_cache; a
sampled request for the same prompt is then answered with that stored answer (the worker
sees nothing of it), while one for another prompt runs live and is not stored; once latency
recovers the step is released and sampled requests run live again."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway
from testkit.scrape import sample

from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENS = load_text_model(None).tokenizer.encode(" one two three", add_special_tokens=False)
LEVEL = "kvflow_router_degradation_level"
TWINS = "kvflow_router_response_cache_twin_lookups_total"
# Small windows and dwells, so the ladder moves within seconds.
FAST_LADDER = {"ttft_slo_s": 0.1, "tpot_slo_s": 10.0, "window_s": 3.0, "engage_after_s": 0.3,
               "release_after_s": 0.5, "min_requests": 3, "check_interval_s": 0.1}  # fmt: skip
CACHE = "x-kvflow-response-cache"
DEGRADED = "x-kvflow-degraded"


def wait_until(what: Callable[[], bool], timeout_s: float, tick: Callable[[], Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        tick()


@contextmanager
def caching_gateway(
    worker: FakeWorker, ladder: dict[str, Any], tmp_path: Path
) -> Iterator[GatewayProcess]:
    """A router with its response cache on and ``ladder`` for the model "fake", in front
    of ``worker``."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"degradation": {"fake": ladder}}))
    with (
        running_fake_worker(worker) as address,
        running_gateway(
            ["--workers", address, "--config", str(path), "--response-cache", "on"]
        ) as g,
    ):
        g.wait_ready(num_workers=1)
        yield g


def level(g: GatewayProcess) -> float:
    return sample(f"{g.url}/metrics", LEVEL, model="fake")


def test_a_degraded_model_answers_a_sampled_request_with_its_greedy_twin(
    tmp_path: Path,
) -> None:
    worker = FakeWorker(tokens=TOKENS)  # serves "fake"
    ladder = {"steps": ["response_cache"], **FAST_LADDER}
    with caching_gateway(worker, ladder, tmp_path) as g:
        url = f"{g.base_url}/chat/completions"

        def post(prompt: str = "stored", **extra: Any) -> httpx.Response:
            messages = [{"role": "user", "content": prompt}]
            body = {"model": "fake", "messages": messages, "max_tokens": 5, **extra}
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r

        # A greedy request stores its answer (top_p and the seed do not key a greedy one).
        assert post(temperature=0, top_p=0.5, seed=4).headers[CACHE] == "miss"
        assert post(temperature=0).headers[CACHE] == "hit"
        stored = post(temperature=0).json()["choices"][0]["message"]["content"]
        calm = post(temperature=0.7)
        assert calm.headers[CACHE] == "bypass" and DEGRADED not in calm.headers

        # Slow first tokens: the ladder takes its one step. Sampled requests for another
        # prompt run live (and slow) meanwhile.
        worker.token_delay_s = 0.15
        wait_until(lambda: level(g) >= 1, 30, lambda: post("climb", temperature=0.7))

        # The same prompt, sampled: the greedy twin's stored answer, no worker involved.
        sent = len(worker.requests)
        r = post(temperature=0.7, top_p=0.9)
        assert (r.headers[CACHE], r.headers[DEGRADED]) == ("hit", "response_cache")
        assert r.json()["choices"][0]["message"]["content"] == stored
        streamed = httpx.post(url, json={"model": "fake", "stream": True, "temperature": 1.0,
                                         "messages": [{"role": "user", "content": "stored"}],
                                         "max_tokens": 5}, timeout=30)  # fmt: skip
        assert streamed.status_code == 200 and streamed.headers[DEGRADED] == "response_cache"
        assert stored.split()[0] in streamed.text
        assert len(worker.requests) == sent
        assert sample(f"{g.url}/metrics", TWINS, result="hit") == 2

        # Several choices or logprobs are not what one greedy answer gives: live.
        for extra in ({"n": 2}, {"logprobs": True}):
            r = post(temperature=0.7, **extra)
            assert r.headers[CACHE] == "bypass" and DEGRADED not in r.headers
            assert len(worker.requests) > sent
            sent = len(worker.requests)

        # A prompt with no greedy answer stored: a miss that runs live, and its sampled
        # answer is not stored as the greedy one.
        r = post("unseen", temperature=0.7)
        assert r.headers[CACHE] == "miss" and DEGRADED not in r.headers
        assert len(worker.requests) == sent + 1
        worker.token_delay_s = 0.0
        assert post("unseen", temperature=0).headers[CACHE] == "miss"

        # Recovered: the step is released, and the same sampled request runs live.
        wait_until(lambda: level(g) == 0, 30, lambda: time.sleep(0.1))
        sent = len(worker.requests)
        r = post(temperature=0.7, top_p=0.9)
        assert r.headers[CACHE] == "bypass" and DEGRADED not in r.headers
        assert len(worker.requests) == sent + 1
        assert post(temperature=0).headers[CACHE] == "hit"  # the greedy answer still serves


def test_an_answer_cut_by_the_cap_step_is_not_stored_for_the_uncapped_request(
    tmp_path: Path,
) -> None:
    """A request that leaves max_tokens out is capped by cap_max_tokens after the cache was
    asked (its default is worked out then), so its key says "no max_tokens": an answer cut
    at the cap stored there would be served, cut and unmarked, after the ladder released."""
    worker = FakeWorker(tokens=TOKENS)
    ladder = {"steps": ["cap_max_tokens"], "max_tokens_cap": 2, **FAST_LADDER}
    with caching_gateway(worker, ladder, tmp_path) as g:
        url = f"{g.base_url}/chat/completions"

        def post(prompt: str, **extra: Any) -> httpx.Response:
            body = {"model": "fake", "messages": [{"role": "user", "content": prompt}],
                    "temperature": 0, **extra}  # fmt: skip
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r

        worker.token_delay_s = 0.15
        wait_until(lambda: level(g) >= 1, 30, lambda: post("climb", max_tokens=5))
        cut = post("no max_tokens")
        assert cut.headers[DEGRADED] == "cap_max_tokens" and cut.headers[CACHE] == "miss"
        assert worker.requests[-1].sampling.max_tokens == 2
        assert cut.json()["choices"][0]["finish_reason"] == "length"
        # A max_tokens the request set itself, at or under the cap: its answer is whole.
        assert post("set", max_tokens=2).headers[CACHE] == "miss"
        assert post("set", max_tokens=2).headers[CACHE] == "hit"

        worker.token_delay_s = 0.0
        wait_until(lambda: level(g) == 0, 30, lambda: time.sleep(0.1))
        whole = post("no max_tokens")
        assert whole.headers[CACHE] == "miss" and DEGRADED not in whole.headers
        assert whole.json()["usage"]["completion_tokens"] > 2  # the worker's whole answer
        assert post("no max_tokens").headers[CACHE] == "hit"
