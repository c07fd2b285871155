"""The Responses API (`/v1/responses`) through the official `openai` client, against a real
gateway and the built-in SmolLM2-135M-Instruct worker: answers equal the chat path's for
the same conversation, streams follow OpenAI's event order and add up to the final
Response, function calls round-trip, text.format constrains the output, stored responses
continue with previous_response_id (across router replicas through a real Redis), and what
kvflow cannot do (hosted tools, images) is a 400 naming the parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from redis import Redis
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.redis_server import running_redis
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False},
}  # fmt: skip
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    w = launch_worker(["--served-model-name", MODEL, "--num-kv-blocks", "256"], timeout_s=300)
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess) -> Iterator[GatewayProcess]:
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address])
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=300)


def test_a_response_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model=MODEL, instructions="Answer in a few words.", temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        max_output_tokens=24, metadata={"ticket": "7"},
    )  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in a few words."},
                  {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content
    assert "Paris" in response.output_text
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.model == MODEL and response.store is True
    assert response.instructions == "Answer in a few words."
    assert response.metadata == {"ticket": "7"} and response.max_output_tokens == 24
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens


def test_a_stream_follows_openais_event_order_and_adds_up(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                    max_output_tokens=40)  # fmt: skip
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=40, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    done = events[-1]
    assert done.type == "response.completed"
    assert text == whole.output_text == done.response.output_text
    assert done.response.id == events[0].response.id  # type: ignore[union-attr]
    assert done.response.usage is not None and whole.usage is not None
    assert done.response.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulator agrees.
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0,
                                 max_output_tokens=40) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_included_logprobs_are_the_chat_paths(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                       max_output_tokens=6, top_logprobs=2,
                                       include=["message.output_text.logprobs"])  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                          messages=[{"role": "user", "content": QUESTION}],
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    [text] = response.output[0].content  # type: ignore[union-attr]
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content
    expected = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
                for t in chat.choices[0].logprobs.content]  # fmt: skip
    got = [(t.token, t.logprob, [a.token for a in t.top_logprobs])
           for t in text.logprobs or []]  # type: ignore[union-attr]  # fmt: skip
    assert got == expected and len(got) == 6
    events = list(client.responses.create(model=MODEL, input=QUESTION, temperature=0,
                                          max_output_tokens=6, top_logprobs=2, stream=True,
                                          include=["message.output_text.logprobs"]))  # fmt: skip
    streamed = [lp.token for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]  # fmt: skip
    assert streamed == [token for token, _, _ in expected]


def test_max_output_tokens_ends_a_response_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    last = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3,
                                        stream=True))[-1]  # fmt: skip
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None


def test_a_function_call_round_trips(client: openai.OpenAI) -> None:
    asked = "What is the weather like in Paris?"
    first = client.responses.create(model=MODEL, input=asked, tools=[WEATHER], temperature=0,
                                    tool_choice="required", parallel_tool_calls=False,
                                    max_output_tokens=60)  # fmt: skip
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and first.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    # Streamed: one function_call item whose argument deltas add up to its arguments.
    events = list(client.responses.create(model=MODEL, input=asked, tools=[WEATHER],
                                          temperature=0, tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=60,
                                          stream=True))  # fmt: skip
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call"
    streamed = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [args_done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == args_done.arguments == call.arguments
    # The call and its output sent back: an answer in text.
    answer = client.responses.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_output_tokens=40,
        input=[{"role": "user", "content": asked},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "sunny, 21 C"}],
    )  # fmt: skip
    assert answer.output_text and answer.output[0].type == "message"


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model=MODEL, input="Name a city in JSON.", temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert set(json.loads(response.output_text)) == {"city"}


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"background": True}, "background", "is not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'function' tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type", "reads text only"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type",
         "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens", "expected a value >= 1"),
        ({"max_output_tokens": 10**9}, "max_output_tokens", "reduce max_output_tokens"),
        ({"temperature": 5}, "temperature", "<= 2"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "'json_schema'"),
        ({"truncation": "auto"}, "truncation", "'disabled'"),
        ({"n": 2}, "n", "Unrecognized request argument"),
    ],
)  # fmt: skip
def test_what_kvflow_cannot_do_is_a_400_naming_the_parameter(
    gateway: GatewayProcess, extra: dict[str, Any], param: str, says: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    answer = httpx.post(f"{gateway.url}/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_stored_response_is_continued_retrieved_and_deleted(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                    max_output_tokens=16)  # fmt: skip
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     max_output_tokens=16,
                                     previous_response_id=first.id)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": "My name is Ada."},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "What is my name?"}],
    )  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # A streamed response is stored before its last event reaches the client.
    events = list(client.responses.create(model=MODEL, input="And again?", stream=True,
                                          previous_response_id=second.id,
                                          max_output_tokens=8))  # fmt: skip
    streamed = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    # store: false keeps nothing.
    unkept = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError, match="is stored for this API key"):
        client.responses.retrieve(unkept.id)
    with pytest.raises(openai.NotFoundError, match="Previous response with id") as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id=unkept.id)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).id == second.id  # the others stay


def test_a_stored_responses_input_items_are_listed_and_paged(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0,
        input=[{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user", "id": "msg_mine",
                "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city":"Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}],
    )  # fmt: skip
    newest_first = list(client.responses.input_items.list(first.id))
    assert [item.type for item in newest_first] == ["function_call_output", "function_call",
                                                    "message", "message"]  # fmt: skip
    assert newest_first[2].id == "msg_mine"  # a given id is kept
    assert newest_first[0].output == "18 C"  # type: ignore[union-attr]
    assert newest_first[1].name == "get_weather"  # type: ignore[union-attr]
    assert newest_first[3].content[0].text == "Be brief."  # type: ignore[union-attr]
    # The SDK's auto-paging follows last_id one item at a time, oldest first.
    paged = list(client.responses.input_items.list(first.id, limit=1, order="asc"))
    assert [item.id for item in paged] == [item.id for item in reversed(newest_first)]
    page = client.responses.input_items.list(first.id, limit=3)
    assert len(page.data) == 3 and page.has_more is True
    # A continuation lists its own input only; a string input is one user message.
    second = client.responses.create(model=MODEL, input="And in Rome?", max_output_tokens=4,
                                     previous_response_id=first.id)  # fmt: skip
    [item] = client.responses.input_items.list(second.id)
    assert item.type == "message" and item.role == "user"  # type: ignore[union-attr]
    assert item.content[0].text == "And in Rome?"  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(first.id, limit=101)
    assert caught.value.body["param"] == "limit"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(first.id, after="msg_nowhere")
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(first.id)


def test_router_replicas_share_stored_responses_through_redis_and_survive_its_loss(
    worker: WorkerProcess,
) -> None:
    with running_redis() as redis:
        flags = ["--served-model-name", MODEL, "--workers", worker.address,
                 "--redis-url", redis.url, "--responses-ttl-s", "600"]  # fmt: skip
        one, two = launch_gateway(flags), launch_gateway(flags)
        try:
            one.wait_ready()
            two.wait_ready()
            at_one = openai.OpenAI(base_url=one.base_url, api_key="x", max_retries=0, timeout=300)
            at_two = openai.OpenAI(base_url=two.base_url, api_key="x", max_retries=0, timeout=300)
            first = at_one.responses.create(model=MODEL, input="My name is Ada.", temperature=0,
                                            max_output_tokens=8)  # fmt: skip
            assert at_two.responses.retrieve(first.id).output_text == first.output_text
            second = at_two.responses.create(model=MODEL, input="My name?", temperature=0,
                                             max_output_tokens=8,
                                             previous_response_id=first.id)  # fmt: skip
            assert second.usage is not None and first.usage is not None
            assert second.usage.input_tokens > first.usage.input_tokens  # the history came
            at_two.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                at_one.responses.retrieve(first.id)
            # Redis down: answers still come, said to be unkept; a continuation is a 503.
            redis.stop()
            unkept = at_one.responses.create(model=MODEL, input="hi", max_output_tokens=4)
            assert unkept.output_text is not None and unkept.store is False
            with pytest.raises(openai.APIStatusError) as caught:
                at_one.responses.create(model=MODEL, input="x", previous_response_id=second.id)
            assert caught.value.status_code == 503
            assert caught.value.response.headers["retry-after"] == "1"
            redis.start()
            kept = at_two.responses.create(model=MODEL, input="hi", max_output_tokens=4)
            assert kept.store is True and at_one.responses.retrieve(kept.id).id == kept.id
            # Kept for --responses-ttl-s, in Redis's own expiry.
            client = Redis.from_url(redis.url)
            try:
                [key] = client.keys(f"kvflow:responses:*:{kept.id}")
                assert 590_000 < client.pttl(key) <= 600_000
            finally:
                client.close()
        finally:
            one.stop()
            two.stop()


def test_a_response_too_large_for_the_memory_store_says_it_was_not_stored(
    worker: WorkerProcess,
) -> None:
    """Before, the in-memory store dropped it silently: the Response said "store": true
    and its first read was a 404."""
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--responses-max-memory-bytes", "4096"])  # fmt: skip
    try:
        g.wait_ready()
        client = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=300)
        small = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        assert small.store is True and client.responses.retrieve(small.id).id == small.id
        large = client.responses.create(model=MODEL, input="word " * 1000, max_output_tokens=2)
        assert large.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(large.id)
        assert "not stored" in g.log and "--responses-max-memory-bytes 4096" in g.log
    finally:
        g.stop()
