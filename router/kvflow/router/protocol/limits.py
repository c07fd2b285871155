"""What one request may ask for: caps checked while parsing, before any work for it.

Every cap bounds work the gateway (or a worker) does per request: choices are tasks and
gRPC streams, stop strings are scanned on every chunk, schemas and grammars are compiled,
messages are rendered and tokenized. A request past one is a 400 naming the cap, its value
and the flag that sets it (docs/router.md, "Request limits"). Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from kvflow.router.protocol.errors import ApiError

# The defaults follow OpenAI's documented limits where it has one (n, stop, logit_bias,
# messages) and vLLM's practice elsewhere, with room for batch clients (lm-eval, guidellm).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 1024
DEFAULT_MAX_N = 128  # OpenAI's
# Prompts x n: each choice is a task and a worker stream. 1024 lets n reach its cap and a
# batch of 1024 prompts through; the issue that set it saw 16,000 choices starve /health.
DEFAULT_MAX_CHOICES_PER_REQUEST = 1024
DEFAULT_MAX_STOP_STRINGS = 4  # OpenAI's
DEFAULT_MAX_STOP_STRING_CHARS = 512
DEFAULT_MAX_STOP_TOKEN_IDS = 128
DEFAULT_MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's
# A schema or grammar: OpenAI caps a structured-output schema near 120,000 characters of
# names and enum values; 128 KiB of JSON text is of that order.
DEFAULT_MAX_SCHEMA_BYTES = 128 * 1024
DEFAULT_MAX_SCHEMA_DEPTH = 64  # JSON nesting levels of the schema text (OpenAI: 10 schema levels)
DEFAULT_MAX_MESSAGES = 2048  # OpenAI's


@dataclass(frozen=True)
class RequestLimits:
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    max_n: int = DEFAULT_MAX_N
    max_choices_per_request: int = DEFAULT_MAX_CHOICES_PER_REQUEST
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias_entries: int = DEFAULT_MAX_LOGIT_BIAS_ENTRIES
    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    max_schema_depth: int = DEFAULT_MAX_SCHEMA_DEPTH
    max_messages: int = DEFAULT_MAX_MESSAGES

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag_of(f.name)} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = RequestLimits()

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def flag_of(name: str) -> str:
    """The router flag that sets the limit ``name`` (router/cli.py)."""
    return "--" + name.replace("_", "-")


def limit_exceeded(param: str, what: str, got: int | str, name: str, value: int) -> ApiError:
    """A 400 naming the parameter, the cap and its flag: "Invalid 'n': at most 128
    choices per prompt, got 129 (this gateway's limit max_n = 128, --max-n)."""
    return ApiError(
        400,
        f"Invalid '{param}': at most {value} {what}, got {got} (this gateway's limit "
        f"{name} = {value}, {flag_of(name)}).",
        param=param,
        code="limit_exceeded",
    )


def check_count(param: str, what: str, count: int, name: str, limits: RequestLimits) -> None:
    value = getattr(limits, name)
    if count > value:
        raise limit_exceeded(param, what, count, name, value)


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (0 for a scalar).
    Linear: one regex pass drops the strings, another all but brackets; only those are
    walked in Python."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    depth = deepest = 0
    for ch in brackets:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def check_schema_size(param: str, source: str, limits: RequestLimits, *, is_json: bool) -> None:
    """Bytes first (free), then, for JSON schemas within them, the nesting depth."""
    # UTF-8 is at most 4 bytes a character: only a source near the cap needs encoding.
    size = len(source) if len(source) * 4 <= limits.max_schema_bytes else len(source.encode())
    if size > limits.max_schema_bytes:
        raise limit_exceeded(param, "bytes", size, "max_schema_bytes", limits.max_schema_bytes)
    if is_json:
        depth = json_depth(source)
        if depth > limits.max_schema_depth:
            raise limit_exceeded(param, "levels of nesting", depth, "max_schema_depth",
                                 limits.max_schema_depth)  # fmt: skip
