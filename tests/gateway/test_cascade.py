"""The model cascade end to end: a real `kvflow router` process in front of scripted gRPC
workers for a small and a large model. The small model answers first; its answer is kept
when confident, and escalated to the large model when its mean logprob is low, when it
breaks the JSON a response_format asked for, or when it refuses. A streaming client never
sees an escalated small answer's tokens; the usage and the spend are both calls'."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway
from testkit.scrape import sample

from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

ENCODE = load_text_model(None).tokenizer.encode
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
SMALL_TEXT, LARGE_TEXT = " Paris", " The capital of France is Paris."
CONFIDENT, UNSURE = [-0.1], [-3.0]
# USD per million tokens: the large model costs ten times the small one.
PRICES = {"small-v1": (1.0, 2.0), "big-v1": (10.0, 20.0)}
SPEND = "kvflow_router_tenant_spend_usd_total"
CASCADE = "kvflow_router_cascade_total"


def tokens(text: str) -> list[int]:
    return list(ENCODE(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[GatewayProcess, FakeWorker, FakeWorker]]:
    small = FakeWorker(model="small-v1")
    large = FakeWorker(model="big-v1", tokens=tokens(LARGE_TEXT))
    with running_fake_worker(small) as small_address, running_fake_worker(large) as large_address:
        config = {
            "pools": [{"name": "big", "served_model_name": "big-v1", "workers": [large_address]},
                      {"name": "small", "served_model_name": "small-v1",
                       "workers": [small_address]}],
            "models": [{"name": "chat", "targets": [{"pool": "big"}]},
                       {"name": "large", "targets": [{"pool": "big"}]},
                       {"name": "small", "targets": [{"pool": "small"}]}],
            "cascade": {"chat": {"small": "small", "large": "large", "checks": {
                "min_mean_logprob": -1.0, "refusal_patterns": ["(?i)\\bI can(no|')t help"]}}},
            "prices": {name: {"input_usd_per_million_tokens": i,
                              "output_usd_per_million_tokens": o}
                       for name, (i, o) in PRICES.items()},
        }  # fmt: skip
        path = tmp_path_factory.mktemp("cascade") / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        with running_gateway(["--config", str(path)]) as g:
            g.wait_ready(num_workers=2)
            yield g, small, large


def script(small: FakeWorker, text: str, logprobs: list[float]) -> None:
    small.tokens, small.token_logprobs = tokens(text), logprobs


def post(g: GatewayProcess, **extra: Any) -> httpx.Response:
    body = {"model": "chat", "messages": MESSAGES, **extra}
    r = httpx.post(f"{g.base_url}/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def events(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def log_lines(g: GatewayProcess, request_id: str, count: int) -> list[str]:
    """The gateway's ``count`` request log lines for ``request_id`` (they arrive on a thread)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [line for line in g.log.splitlines() if f"request_id={request_id} " in line]
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} log lines for {request_id}")


def wait_until(what: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_confident_answer_stays_small(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, large = cluster
    script(small, SMALL_TEXT, CONFIDENT)
    num_large = len(large.requests)
    before = sample(f"{g.url}/metrics", CASCADE, model="chat", outcome="answered_small")
    r = post(g)
    assert r.headers["x-kvflow-cascade"] == "small"
    body = r.json()
    assert body["model"] == "small-v1"
    assert body["choices"][0]["message"]["content"] == SMALL_TEXT
    # The small call asked for logprobs; the client, which did not, sees none.
    assert small.requests[-1].sampling.logprobs
    assert body["choices"][0]["logprobs"] is None
    assert len(large.requests) == num_large  # the large model never ran
    assert body["usage"]["completion_tokens"] == len(tokens(SMALL_TEXT))
    assert sample(f"{g.url}/metrics", CASCADE, model="chat", outcome="answered_small") == before + 1
    # A client that asks for logprobs gets the small call's.
    asked = post(g, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert [t["logprob"] for t in asked] == pytest.approx([-0.1] * len(tokens(SMALL_TEXT)))


def test_a_low_logprob_escalates_and_both_calls_are_counted_and_charged(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, large = cluster
    script(small, SMALL_TEXT, UNSURE)
    metrics = f"{g.url}/metrics"
    spent = {m: sample(metrics, SPEND, model=m) for m in PRICES}
    escalated = sample(metrics, CASCADE, model="chat", outcome="escalated_low_logprob")
    num_small, num_large = len(small.requests), len(large.requests)
    r = post(g)
    assert r.headers["x-kvflow-cascade"] == "escalated:low_logprob"
    body = r.json()
    assert body["model"] == "big-v1"
    assert body["choices"][0]["message"]["content"] == LARGE_TEXT
    assert (len(small.requests), len(large.requests)) == (num_small + 1, num_large + 1)
    # The large call runs the client's request: no logprobs it did not ask for.
    assert not large.requests[-1].sampling.logprobs
    prompt = len(small.requests[-1].prompt_token_ids)
    small_out, large_out = len(tokens(SMALL_TEXT)), len(tokens(LARGE_TEXT))
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt + len(large.requests[-1].prompt_token_ids)
    assert usage["completion_tokens"] == small_out + large_out
    # Each call is charged at the prices of the model that ran it.
    for model, out in (("small-v1", small_out), ("big-v1", large_out)):
        price_in, price_out = PRICES[model]
        want = (prompt * price_in + out * price_out) / 1e6
        assert sample(metrics, SPEND, model=model) - spent[model] == pytest.approx(want)
    after = sample(metrics, CASCADE, model="chat", outcome="escalated_low_logprob")
    assert after == escalated + 1
    # One log line per call, each with the name the client sent, its pool and its spend.
    small_line, large_line = sorted(log_lines(g, r.headers["x-request-id"], 2),
                                    key=lambda line: " pool=small " not in line)  # fmt: skip
    for line, pool in ((small_line, "small"), (large_line, "big")):
        assert f" model=chat pool={pool} " in line
        assert line.endswith(" cascade=escalated:low_logprob")


def test_invalid_json_under_a_response_format_escalates(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, large = cluster
    fmt = {"type": "json_object"}
    large.tokens = tokens('{"city": "Paris"}')
    try:
        script(small, '{"city": "Par', CONFIDENT)  # cut off: not JSON
        r = post(g, response_format=fmt)
        assert r.headers["x-kvflow-cascade"] == "escalated:invalid_json"
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"city": "Paris"}
        script(small, '{"city": "Lyon"}', CONFIDENT)  # valid: kept
        r = post(g, response_format=fmt)
        assert r.headers["x-kvflow-cascade"] == "small"
        # Without a response_format, text that is not JSON is just text.
        script(small, '{"city": "Par', CONFIDENT)
        assert post(g).headers["x-kvflow-cascade"] == "small"
    finally:
        large.tokens = tokens(LARGE_TEXT)


def test_a_refusal_escalates(cluster: tuple[GatewayProcess, FakeWorker, FakeWorker]) -> None:
    g, small, _ = cluster
    script(small, " Sorry, I can't help with that.", CONFIDENT)
    r = post(g)
    assert r.headers["x-kvflow-cascade"] == "escalated:refusal"
    assert r.json()["choices"][0]["message"]["content"] == LARGE_TEXT


def test_a_stream_escalates_before_its_first_token(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, _ = cluster
    script(small, " Marseille, probably", UNSURE)
    r = post(g, stream=True, stream_options={"include_usage": True})
    assert r.headers["x-kvflow-cascade"] == "escalated:low_logprob"
    chunks = events(r)
    # The client sees the large model's tokens only, never the small model's.
    assert streamed_text(chunks) == LARGE_TEXT
    assert "Marseille" not in r.text
    assert {c["model"] for c in chunks} == {"big-v1"}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(tokens(" Marseille, probably")) + len(
        tokens(LARGE_TEXT)
    )
    # A confident small answer is replayed as the stream.
    script(small, SMALL_TEXT, CONFIDENT)
    r = post(g, stream=True)
    assert r.headers["x-kvflow-cascade"] == "small"
    chunks = events(r)
    assert streamed_text(chunks) == SMALL_TEXT
    assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])


def test_the_openai_client_works_against_a_cascade(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, _ = cluster
    client = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=30)
    script(small, SMALL_TEXT, CONFIDENT)
    raw = client.chat.completions.with_raw_response.create(model="chat", messages=MESSAGES)
    assert raw.headers["x-kvflow-cascade"] == "small"
    assert raw.parse().choices[0].message.content == SMALL_TEXT
    script(small, SMALL_TEXT, UNSURE)
    stream = client.chat.completions.create(model="chat", messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == LARGE_TEXT
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(tokens(SMALL_TEXT)) + len(tokens(LARGE_TEXT))
    # The name's own route for another name: no cascade.
    plain = client.chat.completions.with_raw_response.create(model="large", messages=MESSAGES)
    assert "x-kvflow-cascade" not in plain.headers


def test_a_client_that_leaves_during_the_small_answer_cancels_it(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    g, small, large = cluster
    script(small, " one two three four five six seven eight nine ten", CONFIDENT)
    small.token_delay_s = 0.2
    num_cancelled, num_large = len(small.cancelled), len(large.requests)
    metrics = f"{g.url}/metrics"
    spent = sample(metrics, SPEND, model="small-v1")
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{g.base_url}/chat/completions", timeout=0.5,
                       json={"model": "chat", "messages": MESSAGES, "stream": True})  # fmt: skip
        # The small call is cancelled on its worker, and nothing goes to the large model.
        wait_until(lambda: len(small.cancelled) > num_cancelled)
        assert len(large.requests) == num_large
        # It is charged its prompt and the tokens its worker sent before the client left
        # (about 2 at 0.2 s each within 0.5 s), as any request cut short; before, nothing.
        price_in, price_out = PRICES["small-v1"]
        prompt = len(small.requests[-1].prompt_token_ids)
        wait_until(lambda: sample(metrics, SPEND, model="small-v1") > spent)
        spend_pusd = (sample(metrics, SPEND, model="small-v1") - spent) * 1e6
        num_tokens = (spend_pusd - prompt * price_in) / price_out
        assert num_tokens == pytest.approx(round(num_tokens)) and 1 <= round(num_tokens) <= 3
    finally:
        small.token_delay_s = 0.0


def test_a_small_model_that_fails_escalates(
    cluster: tuple[GatewayProcess, FakeWorker, FakeWorker],
) -> None:
    # Last in this module: the small worker stays refused for the router a while after.
    g, small, _ = cluster
    script(small, SMALL_TEXT, CONFIDENT)
    small.mode = "unavailable"
    try:
        r = post(g)
        assert r.headers["x-kvflow-cascade"] == "escalated:small_error"
        assert r.json()["choices"][0]["message"]["content"] == LARGE_TEXT
    finally:
        small.mode = "ok"
