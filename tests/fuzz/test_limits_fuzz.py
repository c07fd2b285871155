"""Property tests of the request limits: bodies drawn on both sides of every cap are
accepted when within all of them and refused with a 400 naming a cap when past one, by the
parser alone and by a real gateway process (small caps set by its flags) in front of a
scripted worker, which never answers 5xx for them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.limits import RequestLimits, flag_of
from kvflow.router.protocol.messages import ChatMessage
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.serving.prompts import PromptBuilder
from kvflow.router.text.model_files import load_text_model

LIMITS = RequestLimits(
    max_prompts_per_request=4, max_n=3, max_choices_per_request=6, max_stop_strings=2,
    max_stop_string_chars=6, max_stop_token_ids=3, max_logit_bias_entries=3,
    max_schema_bytes=400, max_schema_depth=6, max_messages=3,
)  # fmt: skip


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@st.composite
def chat_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    """A chat body near the caps, and whether it is within all of them."""
    num_messages = draw(st.integers(1, LIMITS.max_messages + 2))
    n = draw(st.integers(1, LIMITS.max_n + 2))
    stops = draw(st.lists(st.text("xyz", min_size=1, max_size=LIMITS.max_stop_string_chars + 3),
                          max_size=LIMITS.max_stop_strings + 2))  # fmt: skip
    stop_ids = draw(st.lists(st.integers(0, 100), max_size=LIMITS.max_stop_token_ids + 2))
    bias = draw(st.lists(st.integers(0, 100), max_size=LIMITS.max_logit_bias_entries + 2,
                         unique=True))  # fmt: skip
    depth = draw(st.integers(1, LIMITS.max_schema_depth + 2))
    padding = draw(st.integers(0, LIMITS.max_schema_bytes))
    schema = {"description": "p" * padding, **nested(depth)}
    body = {
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}] * num_messages,
        "n": n,
        "stop": stops or None,
        "stop_token_ids": stop_ids or None,
        "logit_bias": {str(t): 1 for t in bias} or None,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        "max_tokens": 2,
    }
    within = (
        num_messages <= LIMITS.max_messages
        and n <= LIMITS.max_n
        and len(stops) <= LIMITS.max_stop_strings
        and all(len(s) <= LIMITS.max_stop_string_chars for s in stops)
        and len(stop_ids) <= LIMITS.max_stop_token_ids
        and len(bias) <= LIMITS.max_logit_bias_entries
        and len(json.dumps(schema, separators=(",", ":"))) <= LIMITS.max_schema_bytes
        and depth <= LIMITS.max_schema_depth
    )
    return {k: v for k, v in body.items() if v is not None}, within


@st.composite
def completion_bodies(draw: st.DrawFn) -> tuple[dict[str, Any], bool]:
    num_prompts = draw(st.integers(1, LIMITS.max_prompts_per_request + 2))
    n = draw(st.integers(1, LIMITS.max_n + 2))
    as_ids = draw(st.booleans())
    prompts: list[Any] = [[1, 2]] * num_prompts if as_ids else ["hello"] * num_prompts
    within = (
        num_prompts <= LIMITS.max_prompts_per_request
        and n <= LIMITS.max_n
        and num_prompts * n <= LIMITS.max_choices_per_request
    )
    return {"model": "fake", "prompt": prompts, "n": n, "max_tokens": 2}, within


FAST = settings(max_examples=300, deadline=None, database=None)


@FAST
@given(case=chat_bodies())
def test_a_chat_body_within_every_cap_parses_and_one_past_a_cap_is_refused(
    case: tuple[dict[str, Any], bool],
) -> None:
    body, within = case
    _parses_iff_within(parse_chat_request, body, within)


@FAST
@given(case=completion_bodies())
def test_a_completion_body_within_every_cap_parses_and_one_past_a_cap_is_refused(
    case: tuple[dict[str, Any], bool],
) -> None:
    body, within = case
    _parses_iff_within(parse_completion_request, body, within)


def _parses_iff_within(parse: Any, body: dict[str, Any], within: bool) -> None:
    try:
        parse(body, LIMITS)
    except ApiError as exc:
        assert not within, exc.message
        assert (exc.status, exc.code) == (400, "limit_exceeded"), exc.message
        return
    assert within, body


# -- the same through a real gateway ------------------------------------------------------


@pytest.fixture(scope="module")
def small_gateway() -> Iterator[GatewayProcess]:
    flags = [arg for name, value in LIMITS.__dict__.items() for arg in (flag_of(name), str(value))]
    with (
        running_fake_worker(FakeWorker(tokens=(12, 13))) as address,
        running_gateway(["--workers", address, *flags]) as g,
    ):
        g.wait_ready()
        yield g


GATEWAY = settings(
    max_examples=40, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)  # fmt: skip


@pytest.mark.integration
@GATEWAY
@given(chat=chat_bodies(), completion=completion_bodies())
def test_a_gateway_answers_bodies_around_its_caps_with_200_or_a_400_never_5xx(
    small_gateway: GatewayProcess,
    chat: tuple[dict[str, Any], bool],
    completion: tuple[dict[str, Any], bool],
) -> None:
    for path, (body, within) in (("chat/completions", chat), ("completions", completion)):
        r = httpx.post(f"{small_gateway.base_url}/{path}", json=body, timeout=30)
        assert r.status_code < 500, r.text
        if within:
            assert r.status_code == 200, r.text
        else:
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "limit_exceeded", r.text


# -- control tokens in any caller text ----------------------------------------------------

MODEL = load_text_model(None)
BUILDER = PromptBuilder(MODEL)
SPECIAL_IDS = MODEL.tokenizer.special_token_ids
PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "start|>", "<", "|", ">",
          " ", "\n", "system", "user", "a", "\ue000", "\ue001", ":0", "é"]  # fmt: skip


@FAST
@given(
    contents=st.lists(st.lists(st.sampled_from(PIECES), max_size=12).map("".join), min_size=1,
                      max_size=3),
    name=st.none() | st.lists(st.sampled_from(PIECES), max_size=4).map("".join),
)  # fmt: skip
def test_no_caller_text_adds_a_control_token(contents: list[str], name: str | None) -> None:
    messages = [ChatMessage("user", c, name=name) for c in contents]
    prompt = BUILDER.chat(messages)
    # The template's own: the default system turn, one per message, the assistant's header.
    special = [t for t in prompt.token_ids if t in SPECIAL_IDS]
    im_start, im_end = (MODEL.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert special.count(im_start) == len(contents) + 2
    assert special.count(im_end) == len(contents) + 1
    assert len(special) == 2 * len(contents) + 3
    for content in contents:  # what the caller wrote is in the echo, as written
        assert content in prompt.text
