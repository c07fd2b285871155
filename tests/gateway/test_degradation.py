"""Automatic degradation end to end: a real `kvflow router` process in front of scripted
gRPC workers whose speed and queues the test sets. Slow answers drive a model's ladder up
one step at a time (capped max_tokens, extras dropped, the fallback model answering), each
degraded response names its steps in `x-kvflow-degraded`, and once latency recovers the
steps revert; transitions are counted, gauged and logged. A full cluster's 503s drive the
queue_with_deadline step, under which a request waits for capacity up to its deadline."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway
from testkit.scrape import sample

from kvflow.router.api.gateway import build_gateway
from kvflow.router.settings import RouterSettings, parse_config
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENS = load_text_model(None).tokenizer.encode(" one two three", add_special_tokens=False)
MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CAP = 7
LEVEL = "kvflow_router_degradation_level"
TRANSITIONS = "kvflow_router_degradation_transitions_total"
# Small windows and dwells, so the ladder moves within seconds.
FAST_LADDER = {"ttft_slo_s": 0.1, "tpot_slo_s": 10.0, "window_s": 3.0, "engage_after_s": 0.3,
               "release_after_s": 0.5, "min_requests": 3, "check_interval_s": 0.1}  # fmt: skip


def wait_until(what: Callable[[], bool], timeout_s: float, tick: Callable[[], Any]) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        tick()


def request_log_line(g: GatewayProcess, request_id: str) -> str:
    """The gateway's request log line for ``request_id`` (its output arrives on a thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in g.log.splitlines():
            if f"request_id={request_id} " in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}")


def level(g: GatewayProcess, model: str) -> float:
    return sample(f"{g.url}/metrics", LEVEL, model=model)


@pytest.fixture
def big_and_small() -> Iterator[tuple[FakeWorker, FakeWorker, str, str]]:
    big, small = FakeWorker(model="big-v1", tokens=TOKENS), FakeWorker(model="small-v1",
                                                                        tokens=TOKENS)  # fmt: skip
    with running_fake_worker(big) as big_address, running_fake_worker(small) as small_address:
        yield big, small, big_address, small_address


def test_slow_answers_climb_the_ladder_and_recovery_reverts_it(
    big_and_small: tuple[FakeWorker, FakeWorker, str, str], tmp_path: Path
) -> None:
    big, small, big_address, small_address = big_and_small
    config = {
        "pools": [{"name": "big", "served_model_name": "big-v1", "workers": [big_address]},
                  {"name": "small", "served_model_name": "small-v1",
                   "workers": [small_address]}],
        "models": [{"name": "big", "aliases": ["chat"], "targets": [{"pool": "big"}]},
                   {"name": "small", "targets": [{"pool": "small"}]}],
        "degradation": {"big": {
            "steps": ["cap_max_tokens", "drop_extras", "fallback_model"],
            "max_tokens_cap": CAP, "fallback_model": "small", **FAST_LADDER}},
    }  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(["--config", str(path)]) as g:
        g.wait_ready(num_workers=2)
        url = f"{g.base_url}/chat/completions"

        def post(**extra: Any) -> httpx.Response:
            body = {"model": "chat", "messages": MESSAGES, "max_tokens": 500, **extra}
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r

        def served(r: httpx.Response) -> FakeWorker:
            return big if r.json()["model"] == "big-v1" else small

        assert LEVEL in httpx.get(f"{g.url}/metrics").text  # the gauge exists from the start
        assert level(g, "big") == 0
        calm = post()
        assert "x-kvflow-degraded" not in calm.headers
        assert big.requests[-1].sampling.max_tokens == 500

        big.token_delay_s = 0.15  # every first token late for a 0.1 s TTFT target
        wait_until(lambda: level(g, "big") >= 2, 30, post)
        # Steps one and two: capped, and without tools, output format or logprobs.
        r = post(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}},
                 logprobs=True, top_logprobs=2)  # fmt: skip
        steps = r.headers["x-kvflow-degraded"].split(",")
        assert steps[:2] == ["cap_max_tokens", "drop_extras"]
        sent = served(r).requests[-1]
        assert sent.sampling.max_tokens == CAP
        assert not sent.HasField("structured_output")
        assert not sent.sampling.logprobs and sent.sampling.top_logprobs == 0
        message = r.json()["choices"][0]
        assert message["message"]["content"] == " one two three"
        assert not message["message"].get("tool_calls") and message["logprobs"] is None
        stream = httpx.post(url, json={"model": "big", "messages": MESSAGES, "stream": True},
                            timeout=30)  # fmt: skip
        assert stream.status_code == 200
        assert stream.headers["x-kvflow-degraded"].startswith("cap_max_tokens")

        # Step three: the fallback model answers, still capped.
        wait_until(lambda: level(g, "big") >= 3, 30, post)
        r = post()
        assert r.headers["x-kvflow-degraded"] == "cap_max_tokens,fallback_model"
        assert r.json()["model"] == "small-v1"
        assert small.requests[-1].sampling.max_tokens == CAP
        # The log line keeps the name the client sent, and says which steps and pool served.
        line = request_log_line(g, r.headers["x-request-id"])
        assert " model=chat pool=small " in line
        assert " degraded=cap_max_tokens,fallback_model" in line

        big.token_delay_s = 0.0  # recovered: the ladder reverts, one step per calm dwell
        wait_until(lambda: level(g, "big") == 0, 30, lambda: time.sleep(0.1))
        r = post()
        assert "x-kvflow-degraded" not in r.headers
        assert r.json()["model"] == "big-v1" and big.requests[-1].sampling.max_tokens == 500
        assert "degraded=" not in request_log_line(g, r.headers["x-request-id"])

        metrics = f"{g.url}/metrics"
        for step in ("cap_max_tokens", "drop_extras", "fallback_model"):
            assert sample(metrics, TRANSITIONS, model="big", step=step, action="engaged") >= 1
            assert sample(metrics, TRANSITIONS, model="big", step=step, action="released") >= 1
        assert "degradation model=big step=fallback_model action=engaged level=3" in g.log
        assert "degradation model=big step=cap_max_tokens action=released level=0" in g.log
        assert 'reason="TTFT burn' in g.log


def test_a_model_whose_pool_refuses_is_answered_by_its_fallback_at_once(
    big_and_small: tuple[FakeWorker, FakeWorker, str, str], tmp_path: Path
) -> None:
    """No ladder step needed: while every pool of the model refuses requests (its circuit
    open, or no healthy worker), a configured fallback answers instead of a 503; once the
    pool takes requests again, the model answers itself."""
    big, _small, big_address, small_address = big_and_small
    config = {
        "pools": [{"name": "big", "served_model_name": "big-v1", "workers": [big_address]},
                  {"name": "small", "served_model_name": "small-v1",
                   "workers": [small_address]}],
        "models": [{"name": "big", "targets": [{"pool": "big"}]},
                   {"name": "small", "targets": [{"pool": "small"}]}],
        # The ladder never climbs here (an SLO nothing misses): only the circuit acts.
        "degradation": {"big": {"steps": ["cap_max_tokens"], "max_tokens_cap": CAP,
                                "ttft_slo_s": 60.0, "tpot_slo_s": 60.0,
                                "fallback_model": "small"}},
    }  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    # The circuit stays open 10 s: long enough that the checks below never meet a
    # half-open probe, however slow the machine.
    breaker = ["--breaker-min-requests", "2", "--breaker-open-s", "10"]
    with running_gateway(["--config", str(path), *breaker]) as g:
        g.wait_ready(num_workers=2)
        url = f"{g.base_url}/chat/completions"

        def post() -> httpx.Response:
            body = {"model": "big", "messages": MESSAGES, "max_tokens": 5}
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code in (200, 503), r.text  # never a 500
            return r

        def by_fallback(r: httpx.Response) -> bool:
            return r.status_code == 200 and r.json()["model"] == "small-v1"

        first = post()
        assert first.status_code == 200 and first.json()["model"] == "big-v1"
        assert "x-kvflow-degraded" not in first.headers
        big.mode = "unavailable"
        # A refusal or two while the failures open the pool's circuit, then the fallback.
        answers = [post() for _ in range(4)]
        fallback = next((r for r in answers if by_fallback(r)), None)
        assert fallback is not None, [r.text for r in answers]
        assert fallback.headers["x-kvflow-degraded"] == "fallback_model"
        num_big = len(big.requests)
        for _ in range(3):  # the refusing pool is not even tried
            r = post()
            assert by_fallback(r), r.text
        assert len(big.requests) == num_big
        big.mode = "ok"

        def big_answers() -> bool:
            r = post()
            return r.status_code == 200 and r.json()["model"] == "big-v1"

        wait_until(big_answers, 60, lambda: time.sleep(0.5))


def test_a_full_cluster_waits_for_capacity_up_to_the_deadline(tmp_path: Path) -> None:
    worker = FakeWorker(tokens=TOKENS)  # serves "fake"
    config = {"degradation": {"fake": {"steps": ["queue_with_deadline"], "queue_deadline_s": 2,
                                       **FAST_LADDER, "engage_after_s": 0,
                                       "ttft_slo_s": 1.0,
                                       # Capacity, not demand, comes and goes here: the
                                       # requests keep coming as fast while it is back, and
                                       # the release must not wait for them to ease.
                                       "release_offered_ratio": 0}}}  # fmt: skip
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with (
        running_fake_worker(worker) as address,
        running_gateway(
            ["--workers", address, "--config", str(path), "--admission-poll-interval-s", "0.1"]
        ) as g,  # fmt: skip
    ):
        g.wait_ready(num_workers=1)
        url = f"{g.base_url}/chat/completions"
        body = {"model": "fake", "messages": MESSAGES, "max_tokens": 3}

        def full(is_full: bool) -> None:
            worker.num_waiting = worker.max_waiting_requests = 4 if is_full else 0
            time.sleep(0.4)  # a few load polls

        full(True)
        refused = httpx.post(url, json=body, timeout=30)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        # The refusals count as late requests: the ladder takes its one step.
        wait_until(lambda: level(g, "fake") == 1, 30,
                   lambda: httpx.post(url, json=body, timeout=30))  # fmt: skip

        # Capacity comes back within the deadline: the request waited, and is served.
        threading.Timer(0.8, full, [False]).start()
        started_s = time.monotonic()
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started_s >= 0.7
        assert r.headers["x-kvflow-degraded"] == "queue_with_deadline"

        # It does not: a 503 after the deadline, saying it waited.
        full(True)
        started_s = time.monotonic()
        r = httpx.post(url, json=body, timeout=30)
        elapsed_s = time.monotonic() - started_s
        assert r.status_code == 503 and 1.9 <= elapsed_s < 5, (elapsed_s, r.text)
        assert "Waited 2.0 s for capacity (queue_with_deadline)" in r.json()["error"]["message"]

        # Capacity back for good: the step reverts, and a full cluster refuses at once again.
        full(False)
        wait_until(lambda: level(g, "fake") == 0, 30,
                   lambda: httpx.post(url, json=body, timeout=30))  # fmt: skip
        full(True)
        started_s = time.monotonic()
        assert httpx.post(url, json=body, timeout=30).status_code == 503
        assert time.monotonic() - started_s < 1.0


def test_a_ladder_for_a_name_the_one_pool_does_not_serve_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without pools the served name may come from the workers, so the config cannot check
    it; with --served-model-name the gateway can, and says so at startup."""
    ladder = {"steps": ["drop_extras"], "ttft_slo_s": 1, "tpot_slo_s": 1}
    config = parse_config({"degradation": {"fake": ladder, "typo": ladder}})
    with caplog.at_level(logging.WARNING, "kvflow.router"):
        build_gateway(RouterSettings(served_model_name="fake", config=config))
    assert "degradation.typo names no model this gateway serves" in caplog.text
    assert "degradation.fake" not in caplog.text
