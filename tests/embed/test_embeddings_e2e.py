"""/v1/embeddings end to end: a real `kvflow worker --task embed`, a simulated generating
worker, and a real router in front of both (two pools), driven by the official openai
client. Vectors equal the model's own, usage counts the worker's tokens, quotas and spend
apply as for completions, bad input is a 400 naming its field, and each pool refuses the
other's endpoint by name."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.engine_worker.embed.model import StaticEmbedder
from kvflow.engine_worker.embed.model_files import embedding_model_files
from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EMBED = "wordllama-l2-supercat"
GENERATE = "sim"
MAX_INPUTS = 8
MAX_INPUT_TOKENS = 64
TENANTS = {
    "bob": {},
    "alice": {"tokens_per_minute": 30},
    "carol": {"models": [GENERATE]},
}
# 1 USD per input token: spend_pusd is exactly tokens x 10**12.
PRICES = {"input_usd_per_million_tokens": 1_000_000, "output_usd_per_million_tokens": 0}


def key(name: str) -> str:
    return f"sk-{name}-0123456789"


@pytest.fixture(scope="module")
def model() -> StaticEmbedder:
    return StaticEmbedder.load(embedding_model_files(None))


@pytest.fixture(scope="module")
def workers() -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    embedder = launch_worker(["--task", "embed", "--max-embedding-inputs", str(MAX_INPUTS),
                              "--max-embedding-input-tokens", str(MAX_INPUT_TOKENS)])  # fmt: skip
    try:
        generator = launch_worker(["--simulate", "--served-model-name", GENERATE,
                                   "--num-kv-blocks", "512"])  # fmt: skip
    except BaseException:
        embedder.stop(timeout_s=10)
        raise
    yield embedder, generator
    generator.stop(timeout_s=10)
    embedder.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, workers: tuple[WorkerProcess, WorkerProcess]
) -> Iterator[GatewayProcess]:
    embedder, generator = workers
    config = {
        "pools": [
            {"name": "embed", "workers": [embedder.address]},
            {"name": "gen", "served_model_name": GENERATE, "workers": [generator.address]},
        ],
        "tenants": [
            {"name": name, "api_key_sha256": hash_api_key(key(name)), **limits}
            for name, limits in TENANTS.items()
        ],
        "prices": {EMBED: PRICES},
    }
    path: Path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    g = launch_gateway(["--config", str(path)])
    try:
        g.wait_ready(num_workers=2)
        deadline = time.monotonic() + 30  # until the embedding pool's name is known
        while EMBED not in _models(g) and time.monotonic() < deadline:
            time.sleep(0.1)
        yield g
    finally:
        g.stop()


def _models(g: GatewayProcess) -> list[str]:
    response = httpx.get(f"{g.base_url}/models", headers=_auth("bob"), timeout=10)
    return [m["id"] for m in response.json()["data"]]


def _auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key(name)}"}


def _client(g: GatewayProcess, name: str = "bob") -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=key(name), max_retries=0)


def _post(g: GatewayProcess, body: object, name: str = "bob") -> httpx.Response:
    return httpx.post(f"{g.base_url}/embeddings", json=body, headers=_auth(name), timeout=30)


def test_the_openai_client_gets_the_models_vectors(
    gateway: GatewayProcess, model: StaticEmbedder
) -> None:
    client = _client(gateway)
    texts = ["The cat sat on the mat.", "Embeddings map text to vectors", "hello"]
    ids = model.tokenize(texts)
    expected = model.embed(ids, 256).numpy()

    one = client.embeddings.create(model=EMBED, input=texts[0], encoding_format="float")
    assert one.model == EMBED and len(one.data) == 1 and one.data[0].index == 0
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=1e-6)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])

    # The client's default asks for base64 and decodes it itself.
    many = client.embeddings.create(model=EMBED, input=texts)
    assert [d.index for d in many.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=1e-6)
    assert many.usage.prompt_tokens == sum(len(t) for t in ids)

    raw = client.embeddings.create(model=EMBED, input=texts[1], encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[1], atol=1e-6)

    short = client.embeddings.create(model=EMBED, input=texts, dimensions=64)
    cut = model.embed(ids, 64).numpy()
    assert all(len(d.embedding) == 64 for d in short.data)
    np.testing.assert_allclose([d.embedding for d in short.data], cut, atol=1e-6)
    assert np.allclose(np.linalg.norm(cut, axis=1), 1.0, atol=1e-5)

    tokens = client.embeddings.create(model=EMBED, input=[ids[2], ids[0]])
    np.testing.assert_allclose([d.embedding for d in tokens.data], expected[[2, 0]], atol=1e-6)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"model": EMBED, "input": ""}, "input", "empty string"),
        ({"model": EMBED, "input": []}, "input", "is empty"),
        ({"model": EMBED, "input": [[]]}, "input", "empty token array"),
        ({"model": EMBED, "input": [1.5]}, "input", "neither"),
        ({"model": EMBED, "input": [[-1]]}, "input", "negative"),
        ({"model": EMBED, "input": ["x"] * (MAX_INPUTS + 1)}, "input",
         f"at most {MAX_INPUTS} per request"),
        ({"model": EMBED, "input": "x", "dimensions": 100}, "dimensions", "[64, 128, 256]"),
        ({"model": EMBED, "input": "x", "dimensions": 0}, "dimensions", "positive"),
        ({"model": EMBED, "input": "x", "encoding_format": "hex"}, "encoding_format", "one of"),
        ({"model": EMBED, "input": "x", "temperature": 1}, "temperature", "Unrecognized"),
        ({"input": "x"}, "model", "required"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_its_field(
    gateway: GatewayProcess, body: dict[str, object], param: str, says: str
) -> None:
    response = _post(gateway, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert says in error["message"]


def test_inputs_past_the_models_tokens_are_refused_by_the_worker(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_INPUT_TOKENS} tokens"):
        client.embeddings.create(model=EMBED, input=["fine", "word " * 100])
    with pytest.raises(openai.BadRequestError, match="outside wordllama-l2-supercat's vocab"):
        client.embeddings.create(model=EMBED, input=[[5, 40000]])


def test_each_pool_refuses_the_others_endpoint_by_name(gateway: GatewayProcess) -> None:
    response = _post(gateway, {"model": GENERATE, "input": "hello"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_embedding")
    assert f"'{GENERATE}'" in error["message"] and "generates text" in error["message"]

    chat_body = {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}
    chat = httpx.post(
        f"{gateway.base_url}/chat/completions", headers=_auth("bob"), json=chat_body, timeout=30
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "model_not_generating"
    assert f"'{EMBED}'" in chat.json()["error"]["message"]

    missing = _post(gateway, {"model": "text-embedding-3-small", "input": "hi"})
    assert missing.status_code == 404
    assert _post(gateway, {"model": EMBED, "input": "hi"}, name="carol").status_code == 403
    assert httpx.post(f"{gateway.base_url}/embeddings", json={"model": EMBED, "input": "x"},
                      timeout=10).status_code == 401  # fmt: skip


def test_inputs_past_the_tenants_minute_are_a_400_not_a_429(
    gateway: GatewayProcess, model: StaticEmbedder
) -> None:
    """More tokens than alice's whole minute (30) can never be admitted: waiting would not
    help, and each retry of a 429 would embed them again. Refused before the quota takes
    anything (the next test counts alice's minute)."""
    texts = ["one two three four five six seven"] * 8
    assert sum(len(t) for t in model.tokenize(texts)) > 30
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway, "alice").embeddings.create(model=EMBED, input=texts)
    assert refused.value.body["code"] == "tokens_per_minute_exceeded"  # type: ignore[index]
    assert refused.value.body["param"] == "input"  # type: ignore[index]


def test_usage_spend_quota_log_and_metrics(gateway: GatewayProcess, model: StaticEmbedder) -> None:
    text = "one two three four five six seven"
    num_tokens = len(model.tokenize([text])[0])
    # The last request passes the check before embedding (its floor, one token, fits) and
    # is refused when its exact tokens are admitted.
    assert 30 % num_tokens > 0
    client = _client(gateway, "alice")
    before = httpx.get(f"{gateway.base_url}/usage", headers=_auth("alice"), timeout=10).json()
    served = 0
    with pytest.raises(openai.RateLimitError) as refused:
        for _ in range(10):  # 30 tokens per minute last a few requests
            client.embeddings.create(model=EMBED, input=text)
            served += 1
    assert served == 30 // num_tokens
    assert refused.value.response.headers.get("retry-after") is not None
    assert "tokens per minute" in refused.value.message

    usage = httpx.get(f"{gateway.base_url}/usage", headers=_auth("alice"), timeout=10).json()
    used = usage["prompt_tokens"] - before["prompt_tokens"]
    assert used == served * num_tokens
    assert usage["completion_tokens"] == before["completion_tokens"]
    assert usage["spend_pusd"] - before["spend_pusd"] == used * 10**12

    metrics = f"{gateway.url}/metrics"
    assert sample(metrics, "kvflow_router_tenant_prompt_tokens_total", tenant="alice") >= used
    assert sample(metrics, "kvflow_router_requests_total", endpoint="/v1/embeddings",
                  code="200") >= served  # fmt: skip
    assert sample(metrics, "kvflow_router_tenant_spend_usd_total", tenant="alice",
                  model=EMBED) >= used  # fmt: skip
    lines = [ln for ln in gateway.log.splitlines() if "endpoint=embeddings" in ln]
    assert any(re.search(rf"tenant=alice .*prompt_tokens={num_tokens} ", ln) for ln in lines)


def test_the_schema_lists_the_endpoint(gateway: GatewayProcess) -> None:
    schema = httpx.get(f"{gateway.url}/openapi.json", headers=_auth("bob"), timeout=10).json()
    assert "/v1/embeddings" in schema["paths"]
    request = schema["components"]["schemas"]["EmbeddingRequest"]
    assert EMBED in request["properties"]["model"]["enum"]
    assert request["additionalProperties"] is False


def test_workers_announce_their_task_and_refuse_the_other_rpc(
    workers: tuple[WorkerProcess, WorkerProcess],
) -> None:
    embedder, generator = workers
    with grpc.insecure_channel(embedder.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        info = stub.Health(pb.HealthRequest(), timeout=10).info
        assert (info.model, info.task) == (EMBED, pb.TASK_EMBED)
        assert list(info.embedding.allowed_dimensions) == [64, 128, 256]
        assert (info.embedding.max_inputs, info.embedding.max_input_tokens) == (
            MAX_INPUTS,
            MAX_INPUT_TOKENS,
        )
        with pytest.raises(grpc.RpcError) as refused:
            next(iter(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1]), timeout=10)))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--task generate" in (refused.value.details() or "")
    with grpc.insecure_channel(generator.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        assert stub.Health(pb.HealthRequest(), timeout=10).info.task == pb.TASK_UNSPECIFIED
        request = pb.EmbedRequest(inputs=[pb.EmbedInput(text="hi")])
        with pytest.raises(grpc.RpcError) as refused:
            stub.Embed(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert f"({GENERATE})" in (refused.value.details() or "")
        assert "--task embed" in (refused.value.details() or "")
