"""The built-in SmolLM2-135M-Instruct (kvflow worker with no --model): forced tool calls and
a JSON schema come back valid from a real 135M model, through its GGUF vocabulary and
kvflow's Hermes-style tool prompt (its template has no tool support)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather",
     "description": "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
     "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                    "required": ["zone"], "additionalProperties": False}}},
]  # fmt: skip
MESSAGES: Any = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def smollm2() -> Iterator[WorkerProcess]:
    w = launch_worker(["--served-model-name", MODEL, "--num-kv-blocks", "256"], timeout_s=300)
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def client(smollm2: WorkerProcess) -> Iterator[openai.OpenAI]:
    g: GatewayProcess = launch_gateway(["--served-model-name", MODEL, "--workers",
                                        smollm2.address])  # fmt: skip
    try:
        g.wait_ready()
        yield openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0, timeout=300)
    finally:
        g.stop()


def test_smollm2_named_and_required_tool_calls_are_valid(client: openai.OpenAI) -> None:
    named = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    required = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=0,
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    (call,) = required.choices[0].message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")
    assert required.choices[0].finish_reason == "tool_calls"


def test_smollm2_json_schema(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give the weather in Paris as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}},
    )  # fmt: skip
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content or ""), WEATHER)


def _chain_schema(num_links: int) -> dict[str, Any]:
    """A flat chain of references, d1 -> d2 -> ... -> a string: shallow and small (87 KB
    at 2,700 links), within every limit, and one native recursion per link to compile."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1, num_links)}
    defs[f"d{num_links}"] = {"type": "string", "maxLength": 8}
    return {"$defs": defs, "$ref": "#/$defs/d1"}


def test_a_long_reference_chain_compiles_and_kills_neither_process(
    client: openai.OpenAI, smollm2: WorkerProcess
) -> None:
    """Compiled on a default 8 MiB thread stack, this schema overflowed it in llguidance:
    the gateway (which compiles it first, to answer a bad one with a 400) died by SIGSEGV
    with every request in flight, and so did the worker, which compiles it again. On the
    large stack both compile it (proto/stack.py)."""
    schema = _chain_schema(2700)
    assert len(json.dumps(schema, separators=(",", ":"))) > 80_000
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}},
    )  # fmt: skip
    text = response.choices[0].message.content or ""
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), str)
    assert smollm2.proc.poll() is None  # the worker lives
    after = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert after.choices[0].finish_reason == "length"  # and so does the gateway


def test_a_format_past_the_grammar_engines_limits_is_an_error_not_a_cut_answer(
    client: openai.OpenAI,
) -> None:
    """600 optional properties compile, then pass llguidance's items per row at the first
    key: the matcher errs. Its processor allowed only EOS then, and the answer came back a
    200 cut at "{", finish_reason "stop", not of the format, the error unsaid."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "wide", "schema": schema}},
        )  # fmt: skip
    assert "output format cannot be followed" in str(refused.value)
    assert "max is 2000" in str(refused.value)


def test_a_format_too_costly_to_follow_is_refused_not_run(client: openai.OpenAI) -> None:
    """A 15-byte regex whose mask takes about 150 ms a token: run, every step of every
    request on the worker waited for it (four at once: 0.56 s a step)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0,
            extra_body={"structured_outputs": {"regex": "(x{700}){700}"}},
        )  # fmt: skip
    assert "ms a token to follow" in str(refused.value)
    # Formats of the usual cost still run.
    ok = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
        extra_body={"structured_outputs": {"regex": "[a-z]{1,8}"}},
    )  # fmt: skip
    assert ok.choices[0].message.content
