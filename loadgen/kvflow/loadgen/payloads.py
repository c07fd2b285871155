"""The wire side of a benchmark request, pure: the JSON body, and what the answer's error
body and kvflow's route header say.

Fixed output lengths: ``max_tokens`` caps the answer and ``ignore_eos`` (accepted by kvflow
and vLLM, not by OpenAI itself) keeps the model from stopping early, so every request
decodes exactly the tokens the workload asked for and runs compare. With
``ignore_eos=False`` a server may stop sooner; the record counts what it sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvflow.loadgen.text import render_text
from kvflow.loadgen.workload import BenchRequest, prompt_word_ids, segment_text
from kvflow.proto.prefix_outcome import PrefixOutcome, classify_prefix

ROUTE_HEADER = "x-kvflow-route"


class Api(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/chat/completions" if self is Api.CHAT else "/completions"


@dataclass(frozen=True)
class EndpointConfig:
    base_url: str  # up to and including /v1
    model: str
    api: Api = Api.CHAT
    api_key: str | None = None
    ignore_eos: bool = True
    request_timeout_s: float = 600.0
    # Ask kvflow's gateway which worker served each request (x-kvflow-route).
    ask_route: bool = False

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.api.path

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self.ask_route:
            headers[ROUTE_HEADER] = "1"
        return headers


def request_body(config: EndpointConfig, request: BenchRequest) -> dict[str, Any]:
    """A streaming chat (one message per segment) or completions (the words joined) body."""
    body: dict[str, Any] = {"model": config.model}
    if config.api is Api.CHAT:
        body["messages"] = [
            {"role": s.role, "content": segment_text(request.namespace, s)}
            for s in request.segments
        ]
    else:
        body["prompt"] = render_text(prompt_word_ids(request))
    body["max_tokens"] = request.num_output_tokens
    if config.ignore_eos:
        body["ignore_eos"] = True
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def encode_body(config: EndpointConfig, request: BenchRequest) -> bytes:
    return json.dumps(request_body(config, request), separators=(",", ":")).encode()


def error_message(status: int, body: bytes) -> str:
    """OpenAI's ``{"error": {"message": ...}}`` when the body has it, else its start."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        message = parsed["error"].get("message")
        if isinstance(message, str):
            return f"HTTP {status}: {message[:300]}"
    return f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}"


@dataclass(frozen=True)
class RouteInfo:
    worker: str
    prefix_blocks: int | None  # the router's cached-prefix estimate on that worker
    # Where it went relative to its prompt's best holder (kvflow.proto.prefix_outcome),
    # when the gateway reports the best holder's blocks.
    prefix_outcome: PrefixOutcome | None = None


def parse_route_header(value: str | None) -> RouteInfo | None:
    """The last route of ``worker=w1; score=3; prefix_blocks=2; ...[, worker=w2; ...]``.

    Several routes appear when the gateway failed over; the last one served the request.
    A disaggregated route names ``prefill=p1 decode=d1``: the decode worker streamed the
    tokens and holds the prompt's KV afterwards, so it is the route's worker.
    """
    if not value:
        return None
    last = value.split(",")[-1]
    fields = {}
    for part in last.split(";"):
        for word in part.split():
            key, sep, val = word.partition("=")
            if sep:
                fields[key] = val
    worker = fields.get("worker") or fields.get("decode")
    if worker is None:
        return None
    blocks: int | None
    try:
        blocks = round(float(fields["prefix_blocks"]))
    except (KeyError, ValueError):
        blocks = None
    outcome = None
    try:
        best = float(fields["best_prefix_blocks"])
        copied = float(fields.get("prefix_copy", "0")) > 0
    except (KeyError, ValueError):
        pass
    else:
        if blocks is not None:
            outcome = classify_prefix(blocks, best, copied)
    return RouteInfo(worker, blocks, outcome)
