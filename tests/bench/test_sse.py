"""Streaming responses, as the exact lines a server sends, into request records."""

from __future__ import annotations

import json
from typing import Any

from kvflow.loadgen.payloads import parse_route_header
from kvflow.loadgen.sse import StreamAccumulator
from kvflow.proto.prefix_outcome import PrefixOutcome


def data(obj: Any) -> str:
    return "data: " + json.dumps(obj)


def chat(content: str | None, usage: dict[str, Any] | None = None) -> str:
    delta = {} if content is None else {"content": content}
    return data({"object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": None}] if
                 usage is None else [], "usage": usage})  # fmt: skip


def feed(acc: StreamAccumulator, timed_lines: list[tuple[float, str]]) -> None:
    for t, line in timed_lines:
        acc.on_line(line, t)


def test_chat_stream_times_text_chunks_and_reads_usage() -> None:
    acc = StreamAccumulator("r1", scheduled_s=0.9, sent_s=1.0)
    role = data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    usage = {"prompt_tokens": 40, "completion_tokens": 3,
             "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
    feed(acc, [(1.1, role), (1.1, ""), (1.2, ": keep-alive"), (1.3, chat("Hel")), (1.3, ""),
               (1.5, chat("lo")), (1.5, ""), (1.6, chat(None)), (1.6, ""),
               (1.7, chat(None, usage)), (1.7, ""), (1.8, "data: [DONE]"), (1.8, "")])  # fmt: skip
    r = acc.finish(1.9)
    assert r.is_ok, r.error_detail
    assert r.token_times_s == (1.3, 1.5)  # neither the role chunk nor the empty end chunk
    assert r.ttft_s is not None and abs(r.ttft_s - 0.3) < 1e-9
    assert r.num_output_tokens == 3  # usage, not the chunk count
    assert (r.num_prompt_tokens, r.num_cached_tokens) == (40, 32)
    assert abs((r.schedule_lag_s or 0) - 0.1) < 1e-9


def test_completions_stream_without_usage_counts_chunks() -> None:
    acc = StreamAccumulator("r2", scheduled_s=None, sent_s=0.0)
    for i, t in enumerate((0.1, 0.2, 0.4)):
        feed(acc, [(t, data({"choices": [{"index": 0, "text": f"w{i}"}]})), (t, "")])
    feed(acc, [(0.5, "data: [DONE]"), (0.5, "")])
    r = acc.finish(0.5)
    assert r.is_ok
    assert r.num_output_tokens == 3
    assert r.num_prompt_tokens is None and r.num_cached_tokens is None
    assert r.tpot_s is not None and abs(r.tpot_s - 0.15) < 1e-9  # (0.4 - 0.1) / 2


def test_event_split_over_data_lines_and_crlf() -> None:
    acc = StreamAccumulator("r3", None, 0.0)
    chunk = json.dumps({"choices": [{"index": 0, "text": "x"}]})
    # The SSE spec joins an event's data lines with newlines; JSON does not mind.
    feed(acc, [(0.1, "data: " + chunk[:10] + "\r\n"), (0.1, "data: " + chunk[10:]),
               (0.2, ""), (0.3, "data: [DONE]"), (0.3, "")])  # fmt: skip
    r = acc.finish(0.3)
    assert r.is_ok and r.token_times_s == (0.2,)


def test_failures_have_kinds() -> None:
    acc = StreamAccumulator("e1", None, 0.0)
    feed(acc, [(0.1, chat("a")), (0.1, ""),
               (0.2, data({"error": {"message": "worker lost", "type": "server_error"}})),
               (0.2, "")])  # fmt: skip
    r = acc.finish(0.3)
    assert (r.error, r.error_detail) == ("stream_error", "worker lost")
    assert r.ttft_s is None and r.tpot_s is None and r.itls_s == []

    acc = StreamAccumulator("e2", None, 0.0)
    feed(acc, [(0.1, chat("a")), (0.1, "")])
    assert acc.finish(0.2).error == "incomplete"  # no [DONE]

    acc = StreamAccumulator("e3", None, 0.0)
    feed(acc, [(0.1, "data: {not json"), (0.1, ""), (0.2, "data: [DONE]"), (0.2, "")])
    assert acc.finish(0.2).error == "bad_chunk"

    acc = StreamAccumulator("e4", None, 0.0)
    feed(acc, [(0.1, "data: [DONE]"), (0.1, "")])
    assert acc.finish(0.1).error == "no_output"

    acc = StreamAccumulator("e5", None, 0.0)
    r = acc.finish(5.0, error="timeout", error_detail="no answer within 5 s")
    assert (r.error, r.end_s) == ("timeout", 5.0)


def test_route_header_last_route_wins() -> None:
    value = ("worker=w1; score=3; prefix_blocks=2; queue_depth=-1; candidates=2, "
             "worker=w2; score=5; prefix_blocks=4; candidates=1")  # fmt: skip
    route = parse_route_header(value)
    assert route is not None and (route.worker, route.prefix_blocks) == ("w2", 4)
    no_prefix = parse_route_header("worker=w1; score=0; queue_depth=0; candidates=1")
    assert no_prefix is not None and no_prefix.prefix_blocks is None
    assert parse_route_header(None) is None
    assert parse_route_header("garbage") is None


def test_route_header_of_a_disaggregated_plan_names_the_decode_worker() -> None:
    value = ("choice=0; prefill=10.0.0.9:50051 decode=10.0.0.8:50051; plan=disaggregated; "
             "reason=many_missing_tokens; missing_tokens=544; score=4; prefix_blocks=5; "
             "prefill_score=2; prefill_prefix_blocks=2")  # fmt: skip
    route = parse_route_header(value)
    assert route is not None and (route.worker, route.prefix_blocks) == ("10.0.0.8:50051", 5)


def test_route_header_says_where_the_request_went_by_its_prefix() -> None:
    def outcome(value: str) -> PrefixOutcome | None:
        route = parse_route_header(value)
        assert route is not None
        return route.prefix_outcome

    assert outcome("worker=w1; prefix_blocks=4; best_prefix_blocks=4") is PrefixOutcome.BEST_HOLDER
    assert outcome("worker=w1; prefix_blocks=0; best_prefix_blocks=4") is PrefixOutcome.PASSED_OVER
    copy = "worker=w1; prefix_blocks=0; best_prefix_blocks=4; prefix_copy=1"
    assert outcome(copy) is PrefixOutcome.COPY
    assert outcome("worker=w1; prefix_blocks=0; best_prefix_blocks=0") is PrefixOutcome.NO_PREFIX
    # A gateway that does not report the best holder (an older one): no outcome.
    assert outcome("worker=w1; prefix_blocks=4") is None
    # A disaggregated plan's prefill worker has measures of its own: the decode worker's count.
    pd = ("prefill=p1 decode=d1; plan=disaggregated; prefix_blocks=2; best_prefix_blocks=5; "
          "prefill_prefix_blocks=3; prefill_best_prefix_blocks=3")  # fmt: skip
    assert outcome(pd) is PrefixOutcome.PASSED_OVER
