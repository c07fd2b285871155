"""Property tests of the gateway's pure input paths: any input gives a typed result or the
typed error the caller maps to a 400, never another exception (which would be a 500).

- request bodies (protocol/requests.py, messages.py): a ChatRequest/CompletionRequest or
  an ApiError with status 400;
- chat templates (text/chat_template.py): a string or a ChatTemplateError, for the real
  default model's template and for templates that misbehave the way third-party ones do;
- Mooncake trace lines (cli/bench/trace.py): a TraceRecord or a TraceError that names the
  source, the line and, for a field's problem, the field.
"""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
from fuzz.json_strategies import JSON, bodies
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvflow.loadgen.trace import TraceError, TraceRecord, parse_trace, parse_trace_line
from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import (
    ChatRequest,
    CompletionRequest,
    parse_chat_request,
    parse_completion_request,
)
from kvflow.router.text.chat_template import ChatTemplate, ChatTemplateError
from kvflow.router.text.model_files import load_text_model

# Each property runs in about a second; `--hypothesis-seed` reproduces a failure. No
# example database: nothing is written into the tree.
FAST = settings(
    max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def _parses_or_400(parse: Any, body: object, kind: type) -> None:
    try:
        parsed = parse(body)
    except ApiError as exc:
        assert exc.status == 400, (exc.status, exc.message)
        assert exc.message and exc.body()["error"]["type"] == "invalid_request_error"
        return
    assert isinstance(parsed, kind)


@FAST
@given(bodies(is_chat=True))
@example({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "n": 2})
def test_any_chat_body_parses_or_is_a_400(body: object) -> None:
    _parses_or_400(parse_chat_request, body, ChatRequest)


# Found by the property above: a list or object role was hashed and raised TypeError.
@pytest.mark.parametrize("role", [[], {}, ["user"]])
def test_an_unhashable_role_is_a_400(role: object) -> None:
    with pytest.raises(ApiError) as err:
        parse_chat_request({"model": "sim", "messages": [{"role": role, "content": "x"}]})
    assert err.value.status == 400 and err.value.param == "messages[0].role"


@FAST
@given(bodies(is_chat=False))
@example({"model": "sim", "prompt": [[1, 2], [3]], "best_of": 1})
def test_any_completion_body_parses_or_is_a_400(body: object) -> None:
    _parses_or_400(parse_completion_request, body, CompletionRequest)


# Found by schemathesis: past 2**31 - 1 the worker's int32 fields made the conversion raise.
@pytest.mark.parametrize(
    "extra", [{"top_k": 2**31}, {"min_tokens": 2**40}, {"stop_token_ids": [2**31]}]
)
def test_int32_parameters_past_their_range_are_a_400(extra: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as err:
        # A chat body: no max_tokens by default, which would bound min_tokens.
        parse_chat_request({"model": "sim", "messages": [{"role": "user", "content": "hi"}],
                            **extra})  # fmt: skip
    assert err.value.status == 400


# -- chat templates ----------------------------------------------------------------------------

# Shapes that third-party templates have: strict role alternation with raise_exception,
# arithmetic on the message count, string concatenation of a field, a kwarg used as a
# number, a loop over a kwarg.
HOSTILE_TEMPLATES = [
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{{ m['role'] + ': ' + m['content'] }}\n{% endfor %}",
    "{{ messages[0]['content'] * (10 // ([messages|length - 1, 1]|max)) }}",
    "{{ (messages|last)['name'] ~ '|' ~ (messages|last)['name'].upper() }}",
    "{{ 'x' * (budget|int) }}{% for k in extra_list %}{{ k }}{% endfor %}",
    "{{ messages[5]['content'] }}{{ strftime_now(date_format) }}{{ messages|tojson }}",
    "{% set n = messages|length %}{{ range([n * depth|int, 1000]|min)|list|length }}",
]
# Found here: render() once mapped only TemplateError and TypeError to ChatTemplateError, so
# other exceptions raised by template code escaped (a 500 at the gateway).
UNMAPPED_TEMPLATES = [
    ("{{ 10 // (messages|length - 1) }}", ZeroDivisionError),
    ("{{ range(messages|length * 10**6)|list|length }}", OverflowError),  # the sandbox's cap
]


@pytest.fixture(scope="module")
def templates() -> list[ChatTemplate]:
    model = load_text_model(None)
    assert model.chat_template is not None
    return [model.chat_template, *(ChatTemplate(s, "<s>", "</s>") for s in HOSTILE_TEMPLATES)]


TEXT = st.text(max_size=20) | st.sampled_from(["{{", "{% raw %}", "<|im_end|>", "\x00", ""])
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]) | TEXT, "content": TEXT},
        optional={"name": TEXT},
    ),
    max_size=5,
)
KWARG_NAMES = st.sampled_from(
    ["budget", "extra_list", "date_format", "depth", "enable_thinking", "raise_exception",
     "range", "tools"]
) | st.text(string.ascii_letters, min_size=1, max_size=8)  # fmt: skip


@settings(FAST, max_examples=300)
@given(
    messages=MESSAGES,
    extra=st.dictionaries(KWARG_NAMES, JSON, max_size=3),
    add_generation_prompt=st.booleans(),
    which=st.integers(0, len(HOSTILE_TEMPLATES)),
)
@example(
    messages=[{"role": "user", "content": "a"}],
    extra={"depth": 10**9},
    add_generation_prompt=True,
    which=6,
)
@example(messages=[{"role": "user", "content": "a"}], extra={}, add_generation_prompt=True,
         which=2)  # fmt: skip
def test_a_template_renders_or_raises_chat_template_error(
    templates: list[ChatTemplate],
    messages: list[dict[str, str]],
    extra: dict[str, Any],
    add_generation_prompt: bool,
    which: int,
) -> None:
    try:
        text = templates[which].render(
            messages, add_generation_prompt=add_generation_prompt, extra=extra
        )
    except ChatTemplateError as exc:
        assert str(exc)
        return
    assert isinstance(text, str)


@pytest.mark.parametrize(("source", "raised"), UNMAPPED_TEMPLATES)
def test_any_template_failure_is_a_chat_template_error(source: str, raised: type) -> None:
    template = ChatTemplate(source)
    try:
        template.render([{"role": "user", "content": "x"}])
    except raised:
        pytest.fail(f"{raised.__name__} escaped render()")
    except ChatTemplateError:
        return
    pytest.fail("rendered without an error")


def test_the_default_template_renders_every_message_in_order(templates: list[ChatTemplate]) -> None:
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "second"}]
    text = templates[0].render(messages)
    assert text.index("first") < text.index("second")
    assert text.endswith("<|im_start|>assistant\n")


# -- Mooncake traces ---------------------------------------------------------------------------

RECORDS = st.fixed_dictionaries(
    {},
    optional={
        "timestamp": st.integers(-5, 10**6) | st.floats(allow_nan=True) | JSON,
        "input_length": st.integers(-2, 5000) | JSON,
        "output_length": st.integers(-2, 500) | JSON,
        "hash_ids": st.lists(st.integers(-2, 50), max_size=12) | JSON,
    },
)
LINES = st.one_of(
    RECORDS.map(json.dumps),
    JSON.map(json.dumps),
    st.text(max_size=30),
    RECORDS.map(lambda r: json.dumps(r)[:-1]),  # truncated
)


@FAST
@given(line=LINES)
@example(line='{"timestamp": 1e400, "input_length": 1, "output_length": 1, "hash_ids": []}')
@example(line='{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}')
def test_a_trace_line_parses_or_names_its_problem(line: str) -> None:
    try:
        record = parse_trace_line(line, "t.jsonl line 3", block_tokens=512)
    except TraceError as exc:
        message = str(exc)
        assert message.startswith("t.jsonl line 3: "), message
        return
    assert isinstance(record, TraceRecord)
    assert record.input_length >= 1 and record.output_length >= 1
    assert record.timestamp_ms >= 0 and len(record.hash_ids) <= -(-record.input_length // 512)


@FAST
@given(lines=st.lists(LINES | st.just(""), max_size=6))
def test_a_trace_parses_or_names_the_line(lines: list[str]) -> None:
    try:
        records = parse_trace(lines, "t.jsonl")
    except TraceError as exc:
        assert str(exc).startswith("t.jsonl"), str(exc)
        return
    assert 1 <= len(records) <= len(lines)
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
