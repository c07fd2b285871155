"""Tool-call extraction from streamed text, per family, split at every possible point."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import jsonschema
import pytest

from kvflow.router.protocol.messages import ChatMessage, ToolCall
from kvflow.router.protocol.responses import ChoiceDelta, ChoiceResult
from kvflow.router.structured.constraint import check_constraint
from kvflow.router.tools.constrain import forced_call_constraint
from kvflow.router.tools.parsers import family_of_template, parse_llama3_json
from kvflow.router.tools.prompt import prepare_tool_prompt
from kvflow.router.tools.spec import ToolChoice, ToolSpec
from kvflow.router.tools.stream import (
    ArrayCallStream,
    HermesStream,
    Llama3JsonStream,
    NamedCallStream,
    ToolCallExtractor,
)


def run(make: Callable[[], ToolCallExtractor], text: str, cuts: list[int]) -> ChoiceResult:
    """Feed ``text`` cut at ``cuts``, then finish with "stop"; the assembled choice."""
    extractor = make()
    result = ChoiceResult(0)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = extractor.feed(ChoiceDelta(0, piece, finish_reason="stop" if last else None))
        if out is not None:
            result.add(out)
    return result


def every_split(make: Callable[[], ToolCallExtractor], text: str) -> list[ChoiceResult]:
    """One result per single cut position, plus one per character."""
    results = [run(make, text, [k]) for k in range(len(text) + 1)]
    results.append(run(make, text, list(range(1, len(text)))))
    return results


def calls_of(result: ChoiceResult) -> list[tuple[str, dict[str, object]]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in result.tool_calls]  # fmt: skip


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def test_hermes_blocks_are_calls_however_the_text_is_split() -> None:
    for result in every_split(HermesStream, HERMES):
        assert calls_of(result) == [("get_weather", {"city": "Paris"}),
                                    ("get_time", {"zone": "CET"})]  # fmt: skip
        assert result.text.strip() == "Let me check."
        assert result.finish_reason == "tool_calls"
        assert len({c["id"] for c in result.tool_calls}) == 2


def test_hermes_plain_text_and_broken_blocks_stay_content() -> None:
    for text in ["Just text, no <tool here.", "<tool_call>\nnot json\n</tool_call> after"]:
        for result in every_split(HermesStream, text):
            assert result.tool_calls == [] and result.text == text
            assert result.finish_reason == "stop"


def test_hermes_unclosed_block_at_the_end_is_a_call() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}'
    assert calls_of(run(HermesStream, text, [5])) == [("f", {})]


LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def test_llama3_json_calls() -> None:
    for result in every_split(Llama3JsonStream, LLAMA):
        assert calls_of(result) == [("get_weather", {"city": "Oslo"})]
        assert result.finish_reason == "tool_calls" and result.text == ""
    two = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert calls_of(run(Llama3JsonStream, two, [9])) == [("a", {"x": 1}), ("b", {})]
    assert parse_llama3_json("The answer is 4.") is None


def test_llama3_text_answers_stream_as_content() -> None:
    extractor = Llama3JsonStream()
    out = extractor.feed(ChoiceDelta(0, "Hello"))
    assert out is not None and out.text == "Hello"  # not held back to the end
    for result in every_split(Llama3JsonStream, "{not a call} really"):
        assert result.text == "{not a call} really" and not result.tool_calls


ARRAY = (
    '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "unit": "celsius"}}, '
    '{"name": "get_time", "arguments": {"zone": "UTC", "nested": {"a": [1, {"b": 2}]}}}]'
)


def test_required_array_streams_each_calls_arguments() -> None:
    expected = [(c["name"], c["arguments"]) for c in json.loads(ARRAY)]
    for result in every_split(ArrayCallStream, ARRAY):
        assert calls_of(result) == expected
        assert result.finish_reason == "tool_calls"
    extractor = ArrayCallStream()
    head = extractor.feed(ChoiceDelta(0, '[{"name": "get_weather", "arguments": {"ci'))
    assert head is not None
    assert [(d.index, d.name, d.arguments) for d in head.tool_calls] == [(0, "get_weather", '{"ci')]


def test_required_array_with_keys_in_another_order() -> None:
    text = '[{"arguments": {"x": 1}, "name": "f"}]'
    assert calls_of(run(ArrayCallStream, text, [7])) == [("f", {"x": 1})]


def test_named_call_streams_the_text_as_arguments() -> None:
    result = run(lambda: NamedCallStream("f"), '{"a": 1}', [2, 4])
    assert calls_of(result) == [("f", {"a": 1})] and result.finish_reason == "tool_calls"
    assert result.message()["content"] is None


def test_family_of_template() -> None:
    assert family_of_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert family_of_template("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert family_of_template(None) == "hermes"


TOOLS = (
    ToolSpec("get_weather", "", json.dumps({
        "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}})),
    ToolSpec("get_time", "", json.dumps({"type": "object", "properties": {}})),
)  # fmt: skip


def test_required_grammar_keeps_each_tools_definitions() -> None:
    constraint = forced_call_constraint(TOOLS, ToolChoice("required"), parallel=True)
    assert constraint is not None
    check_constraint(constraint, "tools")  # compiles: every $ref resolves at the root
    schema = json.loads(constraint.source)
    good = [{"name": "get_weather", "arguments": {"loc": {"city": "Oslo"}}},
            {"name": "get_time", "arguments": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {"loc": {}}}], schema)
    single = forced_call_constraint(TOOLS, ToolChoice("required"), parallel=False)
    assert single is not None and json.loads(single.source)["maxItems"] == 1
    named = forced_call_constraint(TOOLS, ToolChoice("named", "get_time"), parallel=True)
    assert named is not None and json.loads(named.source) == {"type": "object", "properties": {}}
    assert forced_call_constraint(TOOLS, ToolChoice("auto"), parallel=True) is None


def test_prompt_without_template_support_uses_hermes_instructions() -> None:
    messages = (
        ChatMessage("system", "Be brief."),
        ChatMessage("user", "Weather?"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("c1", "get_time", "{}"),)),
        ChatMessage("tool", "12:00", tool_call_id="c1"),
    )
    out, extra = prepare_tool_prompt(messages, TOOLS, ToolChoice("auto"), "{{ messages }}")
    assert extra == {}
    assert out[0].role == "system" and out[0].content.startswith("Be brief.")
    assert "<tools>" in out[0].content and '"name": "get_weather"' in out[0].content
    assert out[2].content == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert out[3] == ChatMessage("user", "<tool_response>\n12:00\n</tool_response>")


def test_prompt_with_template_support_passes_tools_through() -> None:
    messages = (ChatMessage("user", "Weather?"),)
    out, extra = prepare_tool_prompt(messages, TOOLS, ToolChoice("auto"), "{% if tools %}")
    assert out == list(messages)
    assert [t["function"]["name"] for t in extra["tools"]] == ["get_weather", "get_time"]
    _, none = prepare_tool_prompt(messages, TOOLS, ToolChoice("none"), "{% if tools %}")
    assert none == {}
