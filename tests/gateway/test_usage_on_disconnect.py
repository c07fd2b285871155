"""A request cut short is charged what was computed for it, as vLLM and OpenAI bill one:
its prompt and the completion tokens generated so far, in /v1/usage, the tenant's spend
and the request's log line. Real gateway processes; a `--simulate` worker for a client
that leaves (streamed or not), a scripted one for a worker that dies mid-stream."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, launch_gateway, running_gateway
from testkit.worker_process import launch_worker

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
KEY = "sk-leaver-0123456789"
# 1 pico-USD per prompt token and 1 USD per completion token: a spend shows both counts.
PRICES = {"input_usd_per_million_tokens": "0.000001", "output_usd_per_million_tokens": 1_000_000}
PICO_USD_PER_COMPLETION_TOKEN = 10**12
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
# 20 ms a token: a full answer takes 8 s, so one left after a few tokens is cut short.
STEP_MS = 20
MAX_TOKENS = 400
CHUNKS_READ = 8


def _config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({
        "tenants": [{"name": "leaver", "api_key_sha256": hash_api_key(KEY)}],
        "prices": {model: PRICES},
    }))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    worker = launch_worker(["--simulate", "--served-model-name", MODEL,
                            "--sim-base-step-ms", str(STEP_MS)], timeout_s=120)  # fmt: skip
    try:
        config = _config(tmp_path_factory.mktemp("router"), MODEL)
        g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                            "--config", str(config)])  # fmt: skip
        try:
            g.wait_ready()
            yield g
        finally:
            g.stop()
    finally:
        worker.stop(timeout_s=10)


def _usage(g: GatewayProcess) -> dict[str, Any]:
    answer = httpx.get(f"{g.base_url}/usage", headers={"authorization": f"Bearer {KEY}"})
    answer.raise_for_status()
    usage: dict[str, Any] = answer.json()
    return usage


def _settled(g: GatewayProcess, before: dict[str, Any], timeout_s: float = 10.0) -> dict[str, int]:
    """The tenant's usage added since ``before``, once one more request has settled (a
    request the client left settles when the gateway notices)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = _usage(g)
        if after["requests"] > before["requests"]:
            assert after["requests"] == before["requests"] + 1
            keys = ("prompt_tokens", "completion_tokens", "cached_tokens", "spend_pusd")
            return {key: after[key] - before[key] for key in keys}
        assert time.monotonic() < deadline, f"the request never settled:\n{g.log}"
        time.sleep(0.05)


def _log_fields(g: GatewayProcess, request_id: str) -> dict[str, str]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in g.log.splitlines():
            if f"request_id={request_id} " in line:
                return dict(re.findall(r"(\w+)=(\S+)", line.split("requests: ", 1)[1]))
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}:\n{g.log}")


def _spend_pusd(usage: dict[str, int]) -> int:
    uncached = usage["prompt_tokens"] - usage["cached_tokens"]
    cached_price = 1  # (the cached input price defaults to the input price)
    return (uncached + usage["cached_tokens"] * cached_price
            + usage["completion_tokens"] * PICO_USD_PER_COMPLETION_TOKEN)  # fmt: skip


def _prompt_tokens(g: GatewayProcess) -> int:
    """The prompt's tokens, as a whole answer reports them; charged exactly that."""
    before = _usage(g)
    client = openai.OpenAI(base_url=g.base_url, api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    charged = _settled(g, before)
    assert charged["prompt_tokens"] == answer.usage.prompt_tokens > 0
    assert charged["completion_tokens"] == 2
    assert charged["spend_pusd"] == _spend_pusd(charged)
    return answer.usage.prompt_tokens


def test_a_stream_the_client_closes_is_charged_its_prompt_and_tokens(
    gateway: GatewayProcess,
) -> None:
    prompt_tokens = _prompt_tokens(gateway)
    before = _usage(gateway)
    client = openai.OpenAI(base_url=gateway.base_url, api_key=KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": "left-streamed"},
    )  # fmt: skip
    num_read = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            num_read += 1
            if num_read == CHUNKS_READ:
                break
    stream.response.close()
    charged = _settled(gateway, before)
    assert charged["prompt_tokens"] == prompt_tokens
    # Every chunk read held a token; the answer was cut long before its max_tokens.
    assert CHUNKS_READ <= charged["completion_tokens"] < MAX_TOKENS
    assert charged["spend_pusd"] == _spend_pusd(charged)
    line = _log_fields(gateway, "left-streamed")
    assert int(line["prompt_tokens"]) == prompt_tokens
    assert int(line["completion_tokens"]) == charged["completion_tokens"]
    assert line["finish_reason"] == "none"


def test_an_answer_the_client_abandons_is_charged_its_prompt_and_tokens(
    gateway: GatewayProcess,
) -> None:
    prompt_tokens = _prompt_tokens(gateway)
    before = _usage(gateway)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 2 s of 8
        httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=2.0,
                   headers={"authorization": f"Bearer {KEY}",
                            "x-request-id": "left-collected"})  # fmt: skip
    charged = _settled(gateway, before)
    # The prompt was prefilled, and about 2 s of 20 ms tokens were generated (held in the
    # gateway's buffer for the whole answer; the worker's startup and prefill come first).
    assert charged["prompt_tokens"] == prompt_tokens
    assert 20 <= charged["completion_tokens"] < MAX_TOKENS
    assert charged["spend_pusd"] == _spend_pusd(charged)
    line = _log_fields(gateway, "left-collected")
    assert int(line["prompt_tokens"]) == prompt_tokens


def test_a_stream_its_worker_breaks_is_charged_the_tokens_sent(tmp_path: Path) -> None:
    tokenizer = load_text_model(None).tokenizer
    words = tokenizer.encode(" zebra umbrella quartz" * 4, add_special_tokens=False)
    worker = FakeWorker(tokens=words, mode="die", die_after=5, token_delay_s=0.01)
    config = _config(tmp_path, "fake")
    with (
        running_fake_worker(worker) as address,
        running_gateway(["--workers", address, "--config", str(config)]) as g,
    ):
        g.wait_ready()
        before = _usage(g)
        client = openai.OpenAI(base_url=g.base_url, api_key=KEY, max_retries=0)
        stream = client.completions.create(model="fake", prompt="Once upon a time", stream=True,
                                           max_tokens=len(words))  # fmt: skip
        texts = []
        with pytest.raises(openai.APIError):
            for chunk in stream:
                texts.append(chunk.choices[0].text if chunk.choices else "")
        assert "".join(texts)  # the client got text before the worker died
        charged = _settled(g, before)
        (sent,) = worker.requests
        assert charged["prompt_tokens"] == len(sent.prompt_token_ids)
        assert charged["completion_tokens"] == worker.die_after
        assert charged["spend_pusd"] == _spend_pusd(charged)
