"""The official `openai` client against a real gateway process and real simulated workers.

Simulated workers continue a prompt deterministically (the same prompt always gives the
same tokens), which makes exact text assertions possible without a model.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.proto import worker_pb2 as pb
from kvflow.proto import worker_pb2_grpc as pb_grpc
from kvflow.router.text.model_files import load_text_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
# 2 ms a step: a 30-token answer takes 60 ms, and an unbounded one (up to the 8192-token
# context) about 16 s, long enough to see whether an abort stopped it.
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "2",
            "--num-kv-blocks", "4096"]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def workers() -> Iterator[list[WorkerProcess]]:
    started = [launch_worker(SIM_ARGS, timeout_s=120) for _ in range(2)]
    yield started
    for w in started:
        w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(workers: list[WorkerProcess]) -> Iterator[GatewayProcess]:
    g = launch_gateway(["--served-model-name", MODEL, "--seed", "0",
                        "--workers", ",".join(w.address for w in workers)])  # fmt: skip
    try:
        g.wait_ready(num_workers=2)
        yield g
    finally:
        g.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0, timeout=60)


def wait_workers_idle(workers: list[WorkerProcess], timeout_s: float) -> float:
    """Seconds until no worker runs or queues a request; fails after ``timeout_s``."""
    started = time.monotonic()
    while True:
        busy = []
        for w in workers:
            with grpc.insecure_channel(w.address) as channel:
                load = pb_grpc.WorkerStub(channel).Load(pb.LoadRequest(), timeout=5)
                busy += [load.num_running + load.num_waiting]
        if not any(busy):
            return time.monotonic() - started
        assert time.monotonic() - started < timeout_s, f"workers still busy: {busy}"
        time.sleep(0.05)


def test_models_health_ready_and_metrics(client: openai.OpenAI, gateway: GatewayProcess) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/ready")
    assert ready.status_code == 200 and ready.json()["workers_healthy"] == 2
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'kvflow_router_requests_total{code="200",endpoint="/v1/chat/completions"}' in metrics
    assert 'kvflow_router_tenant_completion_tokens_total{tenant="anonymous"}' in metrics
    assert 'kvflow_router_workers_healthy{pool="default"} 2.0' in metrics


def test_the_gateway_measures_inter_token_latency(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    def itl_count() -> float:
        for line in httpx.get(f"{gateway.url}/metrics").text.splitlines():
            if line.startswith(f'kvflow_router_itl_seconds_count{{model="{MODEL}"}} '):
                return float(line.split()[1])
        raise AssertionError("no kvflow_router_itl_seconds_count")

    before = itl_count()
    stream = client.completions.create(
        model=MODEL, prompt="Tell me", max_tokens=12, stream=True, extra_body=NO_EOS
    )
    num_messages = sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text)
    # One gap per token message after the first (the simulated worker sends one per step).
    assert num_messages >= 2 and itl_count() - before == 11


def test_chat_non_streaming_counts_usage_exactly(client: openai.OpenAI) -> None:
    text_model = load_text_model(None)
    prompt = text_model.chat_template.render(MESSAGES)  # type: ignore[union-attr]
    num_prompt = len(text_model.tokenizer.encode(prompt, add_special_tokens=False))
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=7, extra_body=NO_EOS
    )
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.id.startswith("chatcmpl-")
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert response.usage is not None
    assert response.usage.prompt_tokens == num_prompt
    assert response.usage.completion_tokens == 7
    assert response.usage.total_tokens == num_prompt + 7


def test_chat_streaming_sends_openai_chunks_and_the_same_text(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, extra_body=NO_EOS
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    # On the wire: SSE events, the last one [DONE].
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert "usage" not in json.loads(events[1][6:])  # only with include_usage


def test_continuous_usage_stats_put_each_choices_usage_so_far_on_every_chunk(
    client: openai.OpenAI,
) -> None:
    # vLLM's extension, sent by guidellm and vLLM's benchmarks with every streaming request.
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[list(range(100, 140)), list(range(200, 230))],
            max_tokens=6,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={**NO_EOS, "stream_options": {"include_usage": True,
                                                     "continuous_usage_stats": True}},
        )
    )  # fmt: skip
    *deltas, last = chunks
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40 + 30, 24)
    seen: dict[int, list[int]] = {}
    for chunk in deltas:
        assert chunk.usage is not None, chunk
        (choice,) = chunk.choices
        prompt_tokens = 40 if choice.index < 2 else 30
        assert chunk.usage.prompt_tokens == prompt_tokens
        assert chunk.usage.total_tokens == prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3]
    for counts in seen.values():  # per choice: growing, up to its 6 tokens
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1


def test_vllm_text_and_template_options_through_the_gateway(client: openai.OpenAI) -> None:
    def chat(**extra: object) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, extra_body={**NO_EOS, **extra}
        )

    full = chat().choices[0].message.content
    assert full and len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    assert (
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, stop=[stop], extra_body=NO_EOS
        )
        .choices[0]
        .message.content
        == cut
    )
    kept = chat(stop=[stop], include_stop_str_in_output=True).choices[0].message.content
    assert kept == cut + stop
    # Without the generation prompt the template leaves out "<|im_start|>assistant\n".
    with_header, without = chat().usage, chat(add_generation_prompt=False).usage
    assert with_header is not None and without is not None
    header = load_text_model(None).tokenizer.encode(
        "<|im_start|>assistant\n", add_special_tokens=False
    )
    assert with_header.prompt_tokens - without.prompt_tokens == len(header)
    assert chat(chat_template_kwargs={"enable_thinking": False}).choices[0].message.content == full


def test_completions_prompt_forms_and_n(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="Once upon a time", extra_body=NO_EOS)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.usage is not None and text.usage.completion_tokens == 16  # OpenAI's default
    ids = client.completions.create(model=MODEL, prompt=list(range(100, 140)), max_tokens=4,
                                    extra_body=NO_EOS)  # fmt: skip
    assert ids.usage is not None and ids.usage.prompt_tokens == 40
    batch = client.completions.create(
        model=MODEL, prompt=["first prompt", "second, longer prompt"], n=2, max_tokens=3,
        extra_body=NO_EOS,
    )  # fmt: skip
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # same prompt, deterministic worker
    assert batch.choices[0].text != batch.choices[2].text
    assert batch.usage is not None and batch.usage.completion_tokens == 12
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                              stream=True, extra_body=NO_EOS))  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="Echo me", echo=True, max_tokens=2,
                                       extra_body=NO_EOS)  # fmt: skip
    assert echoed.choices[0].text.startswith("Echo me")


def test_n_choices_stream_interleaved(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, max_tokens=5, stream=True, extra_body=NO_EOS
        )
    )
    texts = {i: "" for i in range(3)}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert texts[0] and texts[0] == texts[1] == texts[2]


# A stop string ends the worker's request by an abort, which lands a few steps later: the
# tokens made meanwhile are counted. 25 steps of 2 ms is 50 ms for the abort to arrive.
ABORT_SLACK_TOKENS = 25


def test_stop_strings_cut_exactly_and_stop_the_worker(
    client: openai.OpenAI, workers: list[WorkerProcess]
) -> None:
    def answer(max_tokens: int) -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=max_tokens, extra_body=NO_EOS
        )
        return response.choices[0].message.content or ""

    text = answer(30)
    assert len(text) > 20
    stop = text[10:13]
    expected = text[: text.find(stop)]
    # The fewest tokens whose text contains the stop string (answers are deterministic and
    # each is a prefix of the next): a binary search over 1..30.
    low, high = 1, 30
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if stop in answer(mid) else (mid + 1, high)
    num_to_stop = low
    assert stop in answer(num_to_stop)
    assert num_to_stop == 1 or stop not in answer(num_to_stop - 1)
    # Unbounded otherwise: up to the context (about 8,000 tokens, 16 s at 2 ms a token).
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, stop=[stop],
                                         extra_body=NO_EOS)  # fmt: skip
    assert cut.choices[0].message.content == expected
    assert cut.choices[0].finish_reason == "stop"
    # The worker stopped right after the stop string (not 16 s later), and its usage counts
    # the tokens it made: those up to the stop, and the few before the abort landed.
    wait_workers_idle(workers, timeout_s=2)
    assert cut.usage is not None
    assert num_to_stop <= cut.usage.completion_tokens <= num_to_stop + ABORT_SLACK_TOKENS
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stop=stop, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS,
    )  # fmt: skip
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    assert usage is not None
    assert num_to_stop <= usage.completion_tokens <= num_to_stop + ABORT_SLACK_TOKENS
    wait_workers_idle(workers, timeout_s=2)


def test_max_tokens_and_stop_token_ids(client: openai.OpenAI, workers: list[WorkerProcess]) -> None:
    for limit in (1, 4):
        r = client.completions.create(model=MODEL, prompt="abc", max_tokens=limit,
                                      extra_body=NO_EOS)  # fmt: skip
        assert r.usage is not None and r.usage.completion_tokens == limit
    # What the worker continues this prompt with, asked directly...
    prompt = list(range(300, 340))
    with grpc.insecure_channel(workers[0].address) as channel:
        request = pb.GenerateRequest(
            request_id="direct-1",
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        tokens = [t for m in pb_grpc.WorkerStub(channel).Generate(request) for t in m.token_ids]
    # ...so its third token, as a stop token id, ends generation after two tokens.
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                  extra_body={"stop_token_ids": [tokens[2]], **NO_EOS})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == load_text_model(None).tokenizer.decode(tokens[:2])
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_client_disconnect_aborts_the_worker_request(
    gateway: GatewayProcess, workers: list[WorkerProcess]
) -> None:
    wait_workers_idle(workers, timeout_s=20)
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # Without the abort the worker would keep generating for about 16 s.
    assert wait_workers_idle(workers, timeout_s=6) < 6
    body = {"model": MODEL, "messages": MESSAGES, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=0.5)
    assert wait_workers_idle(workers, timeout_s=6) < 6


def test_route_header_explains_the_choice(gateway: GatewayProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=body,
                   headers={"x-kvflow-route": "1"})  # fmt: skip
    header = r.headers["x-kvflow-route"]
    assert header.startswith("choice=0; worker=127.0.0.1:")
    # The default scorer: the seconds the request would cost there (routing/cost.py).
    for name in ("score=", "time_cost=", "prefix_blocks=", "session="):
        assert name in header
    assert r.headers["x-request-id"].startswith("req_")
    plain = httpx.post(f"{gateway.base_url}/chat/completions", json=body)
    assert "x-kvflow-route" not in plain.headers
