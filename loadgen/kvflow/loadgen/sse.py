"""Read an OpenAI streaming response, line by line, into a ``RequestRecord``. Pure.

Server-sent events: ``data:`` lines accumulate until a blank line ends the event; lines
starting with ``:`` are comments (keep-alives); ``event:``/``id:``/``retry:`` change
nothing here. OpenAI's stream is JSON chunks, then ``data: [DONE]``. A chunk whose choice
carries text (``delta.content`` for chat, ``text`` for completions) is a token arrival; the
chat stream's first chunk, the role with empty content, is not. The usage chunk (asked for
with ``stream_options.include_usage``) gives the exact token counts; without it the output
count is the number of text chunks. An ``error`` object mid-stream is a failure.
"""

from __future__ import annotations

import json
from typing import Any

from kvflow.loadgen.records import RequestRecord

DONE = "[DONE]"


class StreamAccumulator:
    """Feed it the response's lines with their arrival times; ``finish`` makes the record."""

    def __init__(self, request_id: str, scheduled_s: float | None, sent_s: float) -> None:
        self.request_id = request_id
        self.scheduled_s = scheduled_s
        self.sent_s = sent_s
        self.token_times_s: list[float] = []
        self.usage: dict[str, Any] | None = None
        self.is_done = False
        self.error: str | None = None
        self.error_detail = ""
        self._data: list[str] = []

    def on_line(self, line: str, now_s: float) -> None:
        line = line.rstrip("\r\n")
        if not line:
            if self._data:
                self._on_event("\n".join(self._data), now_s)
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))

    def _fail(self, kind: str, detail: str) -> None:
        if self.error is None:
            self.error, self.error_detail = kind, detail

    def _on_event(self, data: str, now_s: float) -> None:
        if data == DONE:
            self.is_done = True
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            self._fail("bad_chunk", f"not JSON: {data[:200]}")
            return
        if not isinstance(chunk, dict):
            self._fail("bad_chunk", f"not a JSON object: {data[:200]}")
            return
        if "error" in chunk:
            error = chunk["error"]
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            self._fail("stream_error", str(message)[:300])
            return
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if _choice_text(choice):
                self.token_times_s.append(now_s)
                break  # one arrival per chunk, however many choices it carries

    def finish(
        self,
        end_s: float,
        *,
        error: str | None = None,
        error_detail: str = "",
        worker: str | None = None,
        predicted_cached_blocks: int | None = None,
        prefix_outcome: str | None = None,
    ) -> RequestRecord:
        if error is not None:
            self._fail(error, error_detail)
        if self._data:  # a last event without its blank line
            self._on_event("\n".join(self._data), end_s)
            self._data = []
        if self.error is None and not self.is_done:
            self._fail("incomplete", "the stream ended before data: [DONE]")
        if self.error is None and not self.token_times_s:
            self._fail("no_output", "the stream carried no output text")
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        completion_tokens = _count_or_none(usage.get("completion_tokens"))
        return RequestRecord(
            request_id=self.request_id,
            scheduled_s=self.scheduled_s,
            sent_s=self.sent_s,
            end_s=end_s,
            token_times_s=tuple(self.token_times_s),
            num_output_tokens=(
                completion_tokens if completion_tokens is not None else len(self.token_times_s)
            ),
            num_prompt_tokens=_count_or_none(usage.get("prompt_tokens")),
            num_cached_tokens=_count_or_none(cached),
            error=self.error,
            error_detail=self.error_detail,
            worker=worker,
            predicted_cached_blocks=predicted_cached_blocks,
            prefix_outcome=prefix_outcome,
        )


def _choice_text(choice: object) -> str:
    if not isinstance(choice, dict):
        return ""
    delta = choice.get("delta")
    if isinstance(delta, dict):  # chat
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")  # completions
    return text if isinstance(text, str) else ""


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _count_or_none(value: object) -> int | None:
    return value if _is_count(value) else None  # type: ignore[return-value]
