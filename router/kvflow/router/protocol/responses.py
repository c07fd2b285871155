"""Response bodies and stream chunks in exactly the shapes OpenAI sends. Pure builders.

The serving layer produces `ChoiceDelta`s (text and logprobs for one choice) and one
`UsageCounts`; these functions turn them into chat or legacy-completion JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call, as OpenAI streams it: the first piece of call ``index``
    has its ``id`` and ``name``; every piece appends ``arguments`` text."""

    index: int  # the call's position among the choice's calls
    id: str | None
    name: str | None
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice; ``finish_reason`` is set on its last delta only."""

    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    # The choice's tokens so far, for per-chunk usage (vLLM's continuous_usage_stats).
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    tool_calls: tuple[ToolCallDelta, ...] = ()  # chat with tools: calls found in the text


@dataclass
class UsageCounts:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: UsageCounts) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ChoiceResult:
    """A whole choice, for non-streaming responses."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape

    def add(self, delta: ChoiceDelta) -> None:
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        for piece in delta.tool_calls:
            if piece.index == len(self.tool_calls):
                self.tool_calls.append(
                    {
                        "id": piece.id,
                        "type": "function",
                        "function": {"name": piece.name, "arguments": ""},
                    }
                )
            self.tool_calls[piece.index]["function"]["arguments"] += piece.arguments
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason

    def message(self) -> dict[str, Any]:
        """The chat message; with tool calls and no other text, ``content`` is null."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text, "refusal": None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
            if not self.text.strip():
                message["content"] = None
        return message


def _header(response_id: str, kind: str, created_s: int, model: str) -> dict[str, Any]:
    return {"id": response_id, "object": kind, "created": created_s, "model": model}


def _chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": t.token,
                "logprob": t.logprob,
                "bytes": list(t.token_bytes),
                "top_logprobs": [
                    {"token": c.token, "logprob": c.logprob, "bytes": list(c.token_bytes)}
                    for c in t.top
                ],
            }
            for t in items
        ],
        "refusal": None,
    }


def _completion_logprobs(items: Sequence[TokenLogprob], text_offset_start: int) -> dict[str, Any]:
    offsets = []
    offset = text_offset_start
    for t in items:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{c.token: c.logprob for c in t.top} for t in items],
        "text_offset": offsets,
    }


def chat_completion(
    response_id: str,
    created_s: int,
    model: str,
    choices: Sequence[ChoiceResult],
    usage: UsageCounts,
    *,
    with_logprobs: bool,
) -> dict[str, Any]:
    body = _header(response_id, "chat.completion", created_s, model)
    body["choices"] = [
        {
            "index": c.index,
            "message": c.message(),
            "logprobs": _chat_logprobs(c.logprobs) if with_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    body["usage"] = usage.as_dict()
    body["system_fingerprint"] = None
    return body


def text_completion(
    response_id: str,
    created_s: int,
    model: str,
    choices: Sequence[ChoiceResult],
    usage: UsageCounts,
    *,
    with_logprobs: bool,
) -> dict[str, Any]:
    body = _header(response_id, "text_completion", created_s, model)
    body["choices"] = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": _completion_logprobs(c.logprobs, 0) if with_logprobs else None,
            "finish_reason": c.finish_reason,
        }
        for c in choices
    ]
    body["usage"] = usage.as_dict()
    body["system_fingerprint"] = None
    return body


class ChunkWriter:
    """Serializes one stream's chunks as SSE events; remembers per-choice text offsets."""

    def __init__(
        self,
        response_id: str,
        created_s: int,
        model: str,
        *,
        is_chat: bool,
        with_logprobs: bool,
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> None:
        self._header = _header(
            response_id,
            "chat.completion.chunk" if is_chat else "text_completion",
            created_s,
            model,
        )
        self._is_chat = is_chat
        self._with_logprobs = with_logprobs
        self.include_usage = include_usage
        self._continuous_usage = continuous_usage
        self._text_offsets: dict[int, int] = {}

    def _event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        chunk = dict(self._header)
        chunk["choices"] = choices
        if self._is_chat:
            chunk["system_fingerprint"] = None
        if self.include_usage:
            chunk["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
        return sse_event(chunk)

    def role(self, index: int) -> bytes:
        """The chat stream's first chunk for a choice: the role, with empty content."""
        assert self._is_chat
        delta = {"role": "assistant", "content": "", "refusal": None}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return self._event([choice], None)

    def delta(self, delta: ChoiceDelta) -> bytes:
        choice: dict[str, Any] = {"index": delta.index}
        if self._is_chat:
            # The last chunk of a choice carries an empty delta and the finish reason.
            is_empty_end = (
                not delta.text and not delta.tool_calls and delta.finish_reason is not None
            )
            choice["delta"] = {} if is_empty_end else {"content": delta.text}
            if delta.tool_calls:
                choice["delta"] = {"tool_calls": [t.as_dict() for t in delta.tool_calls]}
                if delta.text:
                    choice["delta"]["content"] = delta.text
            logprobs = _chat_logprobs(delta.logprobs) if delta.logprobs else None
        else:
            choice["text"] = delta.text
            start = self._text_offsets.get(delta.index, 0)
            self._text_offsets[delta.index] = start + len(delta.text)
            logprobs = _completion_logprobs(delta.logprobs, start) if delta.logprobs else None
        choice["logprobs"] = logprobs if self._with_logprobs else None
        choice["finish_reason"] = delta.finish_reason
        usage = None
        if self._continuous_usage:
            prompt, completion = delta.num_prompt_tokens, delta.num_completion_tokens
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}  # fmt: skip
        return self._event([choice], usage)

    def usage(self, usage: UsageCounts) -> bytes:
        return self._event([], usage.as_dict())


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(error_body: dict[str, Any]) -> bytes:
    """A mid-stream failure: the `openai` client raises an APIError on this event."""
    return sse_event(error_body)
