"""OpenAI-shaped errors from a real gateway process in front of a real simulated worker:
the status, the body's four fields and the request id, for bad input and for no worker."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway, running_gateway
from testkit.ports import free_port
from testkit.worker_process import launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    worker = launch_worker(["--simulate", "--served-model-name", MODEL], timeout_s=120)
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address])
    try:
        g.wait_ready(num_workers=1)
        yield g
    finally:
        g.stop()
        worker.stop(timeout_s=10)


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize(
    ("kwargs", "status", "fragment"),
    [
        ({"extra_body": {"foo": 1}}, 400, "Unrecognized request argument supplied: foo"),
        ({"temperature": 3}, 400, "temperature"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"n": 500}, 400, "'n'"),
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, 400, "tools[0]"),
        # Simulated workers have no model to constrain: the worker's refusal is a 400.
        ({"response_format": {"type": "json_object"}}, 400, "simulates a model"),
        ({"max_tokens": 9000}, 400, "maximum context length is 8192"),
        ({"model": "no-such-model"}, 404, "does not exist"),
    ],
)
def test_errors_have_openai_shape_and_status(
    client: openai.OpenAI, kwargs: dict[str, object], status: int, fragment: str
) -> None:
    args: dict[str, object] = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(**args)  # type: ignore[call-overload]
    assert info.value.status_code == status
    body = info.value.response.json()["error"]
    assert fragment in body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    assert info.value.response.headers["x-request-id"].startswith("req_")


def test_prompt_longer_than_the_context_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[100] * 8200, max_tokens=1)
    assert info.value.code == "context_length_exceeded"


def test_body_too_large_bad_json_and_unknown_paths(gateway: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="x" * (9 * 1024 * 1024))
    assert info.value.status_code == 413
    r = httpx.post(f"{gateway.base_url}/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "could not parse the JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    # 100,000 nested arrays (200 KB) overflow Python's parser: a 400, not a 500.
    deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(f"{gateway.base_url}/chat/completions", content=deep,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert httpx.get(gateway.base_url.removesuffix("/v1") + "/health").status_code == 200
    r = httpx.get(f"{gateway.base_url}/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        # a lone surrogate: the tokenizer raised on it, a 500
        (
            b'"messages": [{"role": "user", "content": "a\\ud800b"}]',
            "messages[0].content",
            "lone UTF-16 surrogate",
        ),
        (
            b'"messages": [{"role": "user", "content": "hi"}], "temperature": NaN',
            None,
            "NaN is not a JSON number",
        ),  # passed the range check, refused by the worker
        (b'"messages": [{"role": "user", "content": "hi"}], "top_p": 0', "top_p", "> 0"),
    ],
)
def test_what_json_loads_takes_but_is_no_request_is_a_400(
    gateway: GatewayProcess, raw: bytes, param: str | None, fragment: str
) -> None:
    with httpx.Client(base_url=gateway.base_url) as http:  # one connection throughout
        r = http.post("/chat/completions", content=b'{"model": "sim", ' + raw + b"}",
                      headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert fragment in error["message"] and error["param"] == param
        ok = http.post("/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                  "max_tokens": 2})  # fmt: skip
        assert ok.status_code == 200


def test_no_healthy_worker_is_a_503_with_retry_after() -> None:
    with_nothing = f"127.0.0.1:{free_port()}"
    g = launch_gateway(["--served-model-name", MODEL, "--workers", with_nothing])
    try:
        assert httpx.get(f"{g.url}/ready").status_code == 503
        client = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert info.value.status_code == 503
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert "No healthy worker" in info.value.response.json()["error"]["message"]
    finally:
        g.stop()
    # Without --served-model-name the model comes from the workers: none answered yet.
    with running_gateway(["--workers", with_nothing]) as g:
        r = httpx.post(
            f"{g.base_url}/chat/completions", json={"model": MODEL, "messages": MESSAGES}
        )
        assert r.status_code == 503 and "No worker has reported" in r.json()["error"]["message"]
