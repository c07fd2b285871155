"""Tool calls out of a choice's text deltas, as they stream. One extractor per choice.

Each ``feed`` takes the decoder's delta (content text, logprobs, maybe the finish reason)
and returns what the client should see: content that is surely not part of a call, and
``ToolCallDelta`` pieces. A choice that made calls and stopped finishes with
``tool_calls``, as OpenAI's does.

- ``NamedCallStream``: the output *is* the arguments (a grammar forced them): each text
  delta is an arguments delta of call 0, streamed as it comes.
- ``ArrayCallStream``: the ``required`` grammar's ``[{"name": ..., "arguments": {...}}]``;
  a call's header goes out once its name is complete, then its arguments as they grow.
- ``HermesStream``: content until ``<tool_call>``, then the block is held until
  ``</tool_call>`` and sent as one call (name and whole arguments).
- ``Llama3JsonStream``: an answer that starts with ``{`` (or ``<|python_tag|>``) is held to
  the end and parsed as calls; any other answer is content, streamed.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Protocol

from kvflow.router.protocol.responses import ChoiceDelta, ToolCallDelta
from kvflow.router.tools.parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    PYTHON_TAG,
    ParsedCall,
    call_from_json,
    new_call_id,
    parse_llama3_json,
)

# A call's text up to the "{" that opens its arguments.
_ARRAY_CALL_HEAD = re.compile(r'^\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*\{$')


class ToolCallExtractor(Protocol):
    def feed(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        """What to send for ``delta``; None when there is nothing to send yet."""
        ...


class _Base:
    def __init__(self) -> None:
        self.num_calls = 0

    def _whole_call(self, call: ParsedCall) -> ToolCallDelta:
        piece = ToolCallDelta(self.num_calls, new_call_id(), call.name, call.arguments)
        self.num_calls += 1
        return piece

    def _out(self, delta: ChoiceDelta, text: str, calls: list[ToolCallDelta]) -> ChoiceDelta | None:
        finish = delta.finish_reason
        if finish == "stop" and self.num_calls:
            finish = "tool_calls"
        if not text and not calls and not delta.logprobs and finish is None:
            return None
        return replace(delta, text=text, tool_calls=tuple(calls), finish_reason=finish)


class NamedCallStream(_Base):
    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        calls = []
        if delta.text or (delta.finish_reason is not None and not self.num_calls):
            is_first = not self.num_calls
            calls.append(ToolCallDelta(0, new_call_id() if is_first else None,
                                       self._name if is_first else None, delta.text))  # fmt: skip
            self.num_calls = 1
        return self._out(delta, "", calls)


class ArrayCallStream(_Base):
    """Depth 1 is the array, 2 a call object, 3 and deeper its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element = ""  # the current call's text, except its streamed arguments
        self._in_arguments = False
        self._streamed_head = False

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        calls: list[ToolCallDelta] = []
        arguments = ""
        for ch in delta.text:
            if self._in_arguments:
                arguments += ch
            elif self._depth >= 2 or (self._depth == 1 and ch == "{"):
                self._element += ch
            closed = self._step(ch)
            if self._in_arguments:
                if closed and self._depth == 2:
                    self._in_arguments = False
            elif self._depth == 3 and ch == "{" and not self._streamed_head:
                match = _ARRAY_CALL_HEAD.match(self._element)
                if match:
                    name = json.loads(match.group(1))
                    calls.append(ToolCallDelta(self.num_calls, new_call_id(), name, ""))
                    self._in_arguments = self._streamed_head = True
                    arguments += ch
            if closed and self._depth == 1 and self._element:
                if arguments:
                    calls.append(ToolCallDelta(self.num_calls, None, None, arguments))
                    arguments = ""
                calls += self._end_element()
        if arguments:
            calls.append(ToolCallDelta(self.num_calls, None, None, arguments))
        return self._out(delta, "", _merge(calls))

    def _end_element(self) -> list[ToolCallDelta]:
        out = []
        if self._streamed_head:
            self.num_calls += 1
        else:  # the keys came in another order: send the whole call at once
            call = call_from_json(self._element)
            if call is not None:
                out.append(self._whole_call(call))
        self._element = ""
        self._streamed_head = False
        return out

    def _step(self, ch: str) -> bool:
        """Track strings and depth; True when ``ch`` closed an object or array."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
            return False
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            return True
        return False


def _merge(calls: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Adjacent pieces of one call as one piece (one chunk per call and step)."""
    out: list[ToolCallDelta] = []
    for piece in calls:
        last = out[-1] if out else None
        if last is not None and last.index == piece.index and piece.id is None:
            out[-1] = replace(last, arguments=last.arguments + piece.arguments)
        else:
            out.append(piece)
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesStream(_Base):
    def __init__(self) -> None:
        super().__init__()
        self._pending = ""  # content held back: it may begin a <tool_call>
        self._block: str | None = None  # inside a <tool_call>: its text so far

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        text = self._pending + delta.text
        self._pending = ""
        content = ""
        calls: list[ToolCallDelta] = []
        while text:
            if self._block is None:
                start = text.find(HERMES_OPEN)
                if start < 0:
                    keep = _partial_suffix(text, HERMES_OPEN)
                    content += text[: len(text) - keep]
                    self._pending = text[len(text) - keep :]
                    break
                content += text[:start]
                self._block = ""
                text = text[start + len(HERMES_OPEN) :]
            else:
                end = (self._block + text).find(HERMES_CLOSE)
                if end < 0:
                    self._block += text
                    break
                joined = self._block + text
                content, calls = self._close_block(joined[:end], HERMES_CLOSE, content, calls)
                text = joined[end + len(HERMES_CLOSE) :]
        if delta.finish_reason is not None:
            if self._block is not None:  # never closed: a call if it parses, else text
                content, calls = self._close_block(self._block, "", content, calls)
            content += self._pending
            self._pending = ""
        if self.num_calls and not content.strip():
            content = ""  # the newlines between calls are not content
        return self._out(delta, content, calls)

    def _close_block(
        self, body: str, closing: str, content: str, calls: list[ToolCallDelta]
    ) -> tuple[str, list[ToolCallDelta]]:
        """A finished block: one more call, or (not a call) more content, as written."""
        self._block = None
        call = call_from_json(body.strip())
        if call is None:
            return content + HERMES_OPEN + body + closing, calls
        return content, [*calls, self._whole_call(call)]


class Llama3JsonStream(_Base):
    def __init__(self) -> None:
        super().__init__()
        self._held: str | None = ""  # None once the answer is known to be plain content

    def feed(self, delta: ChoiceDelta) -> ChoiceDelta | None:
        if self._held is None:
            return self._out(delta, delta.text, [])
        self._held += delta.text
        head = self._held.lstrip()
        could_be_call = head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)])
        if head and not could_be_call and not head.startswith(PYTHON_TAG):
            text, self._held = self._held, None
            return self._out(delta, text, [])
        if delta.finish_reason is None:
            return self._out(delta, "", [])
        parsed = parse_llama3_json(self._held)
        if parsed is None:
            text, self._held = self._held, None
            return self._out(delta, text, [])
        self._held = None
        return self._out(delta, "", [self._whole_call(c) for c in parsed])
