"""response_format and kvflow's structured_outputs with the official openai client, end to
end: gateway -> gRPC -> a real torch worker masking every step."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from testkit.structured_schemas import SCHEMAS

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a user as JSON."}]


def json_schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(client: openai.OpenAI, name: str) -> None:
    schema = SCHEMAS[name]
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=json_schema_format(name, schema),
        max_tokens=200, n=2, seed=7,
    )  # fmt: skip
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_json_schema_streams_valid_json(client: openai.OpenAI) -> None:
    schema = SCHEMAS["nested_enum_array"]
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format=json_schema_format("s", schema),
        max_tokens=200, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)


class Household(pydantic.BaseModel):
    pets: list[Pet] = pydantic.Field(max_length=3)
    city: Literal["Paris", "Oslo"]


def test_openai_parse_helper_returns_the_model(client: openai.OpenAI) -> None:
    # The helper sends a strict json_schema with $defs (Pet) and parses the answer.
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Household, max_tokens=300
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Household)
    assert all(isinstance(p, Pet) for p in parsed.pets)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    # Any object: a random model may write a long one, so only a length stop is excused.
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}, max_tokens=40,
    )  # fmt: skip
    text = response.choices[0].message.content or ""
    assert text.startswith("{")
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("extension", "pattern"),
    [
        ({"regex": r"[A-Z]{2}-[0-9]{4}"}, r"[A-Z]{2}-[0-9]{4}"),
        ({"choice": ["yes", "no", "maybe"]}, r"yes|no|maybe"),
        ({"grammar": 'root ::= "v" [0-9] "." [0-9]'}, r"v[0-9]\.[0-9]"),
        ({"grammar": 'start: "ok" | "not ok"'}, r"ok|not ok"),
    ],
)
def test_structured_outputs_extension(
    client: openai.OpenAI, extension: dict[str, Any], pattern: str
) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20,
        extra_body={"structured_outputs": extension},
    )  # fmt: skip
    assert re.fullmatch(pattern, response.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"response_format": json_schema_format("bad", {"type": "strin"})},
         "response_format.json_schema.schema", "strin"),
        ({"response_format": json_schema_format("bad", {"$ref": "#/$defs/nope"})},
         "response_format.json_schema.schema", "nope"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
         "response_format.json_schema.name", "letters"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}},
         "structured_outputs.regex", "unclosed group"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
         "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_object"},
          "extra_body": {"structured_outputs": {"regex": "a"}}},
         "structured_outputs", "one format at a time"),
    ],
)  # fmt: skip
def test_a_rejected_format_is_a_400_naming_it(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, **kwargs)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == param
    assert fragment in body["message"]


def test_the_worker_itself_refuses_a_bad_format(tiny_worker: Any) -> None:
    # The gateway checks formats first; a worker still refuses one on its own (another
    # client, or a gateway of another version), naming the problem.
    import grpc

    from kvflow.proto import worker_pb2 as pb
    from kvflow.proto import worker_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(request_id="bad-format", prompt_token_ids=[1, 2, 3])
    request.structured_output.json_schema = '{"type": "strin"}'
    with grpc.insecure_channel(tiny_worker.address) as channel:
        stub = pb_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "strin" in (info.value.details() or "")
        ok = pb.GenerateRequest(request_id="good-format", prompt_token_ids=[1, 2, 3])
        ok.structured_output.regex = "[a-c]{3}"
        ok.sampling.max_tokens = 10
        tokens = [t for m in stub.Generate(ok, timeout=60) for t in m.token_ids]
        assert 1 <= len(tokens) <= 3  # three one-letter tokens at most, then EOS
