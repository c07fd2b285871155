"""Parse the sampling fields of a request body that need more than a type and a range.

Pure: no I/O. Each function takes the body's ``Fields`` and returns a plain value or raises
the OpenAI-style 400 that names the field; ``requests`` assembles them into SamplingOptions.
"""

from __future__ import annotations

from kvflow.router.protocol.errors import invalid_request
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type
from kvflow.router.protocol.limits import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_LOGIT_BIAS_ENTRIES,
    DEFAULT_MAX_STOP_STRINGS,
    RequestLimits,
    check_count,
    limit_exceeded,
)

MAX_INT32 = 2**31 - 1  # the worker's SamplingParams holds these counts as int32
MAX_STOP_STRINGS = DEFAULT_MAX_STOP_STRINGS  # the default; the gateway's is in RequestLimits
MAX_PENALTY = 2  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100  # OpenAI's range for one bias: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = DEFAULT_MAX_LOGIT_BIAS_ENTRIES  # the default, as above


def stop_strings(fields: Fields, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise invalid_type("stop", "a string or an array of strings", value)
    # The count before looking at the items: a million of them is refused without a scan.
    check_count("stop", "stop strings", len(stops), "max_stop_strings", limits)
    if not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop", "a string or an array of strings", value)
    if any(s == "" for s in stops):
        raise invalid_request("Invalid 'stop': stop strings must not be empty.", param="stop")
    # Stop strings are matched on every chunk of every choice; their length bounds the
    # text held back and scanned (text/stop.py).
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise limit_exceeded("stop", "characters in a stop string", longest,
                             "max_stop_string_chars", limits.max_stop_string_chars)  # fmt: skip
    return tuple(stops)


def stop_token_ids(fields: Fields, limits: RequestLimits = DEFAULT_LIMITS) -> tuple[int, ...]:
    value = fields.raw("stop_token_ids")
    if value is None:
        return ()
    if isinstance(value, list):
        check_count("stop_token_ids", "token ids", len(value), "max_stop_token_ids", limits)
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT32 for v in value
    ):
        raise invalid_type("stop_token_ids", "an array of token ids (0 to 2**31 - 1)", value)
    return tuple(value)


def max_tokens(fields: Fields, default: int | None) -> int | None:
    legacy = fields.integer("max_tokens", low=1)
    new = fields.integer("max_completion_tokens", low=1)
    if legacy is not None and new is not None and legacy != new:
        raise invalid_request(
            "Pass one of 'max_tokens' and 'max_completion_tokens', not both.",
            param="max_completion_tokens",
        )
    chosen = new if new is not None else legacy
    return default if chosen is None else chosen


def logit_bias(
    fields: Fields, limits: RequestLimits = DEFAULT_LIMITS
) -> tuple[tuple[int, float], ...]:
    value = fields.raw("logit_bias")
    if value is None:
        return ()
    biases = as_mapping(value, "logit_bias")
    check_count("logit_bias", "entries", len(biases), "max_logit_bias_entries", limits)
    pairs: dict[int, float] = {}
    for key, bias in biases.items():
        # JSON object keys are strings; OpenAI takes decimal token ids.
        # At most 10 digits: a token id is an int32, and int() refuses past 4,300 (a 500).
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise invalid_request(
                f"Invalid key in 'logit_bias': {key}. You should only be submitting "
                "non-negative integers (token ids).",
                param="logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise invalid_type(f"logit_bias.{key}", "a decimal", bias)
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid_request(
                f"Invalid value for 'logit_bias' token {key}: {bias}; a bias must be in "
                f"[-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}].",
                param="logit_bias",
            )
        pairs[int(key)] = float(bias)  # "007" and "7" are one token: the last one wins
    return tuple(sorted(pairs.items()))


def min_tokens(fields: Fields, max_tokens: int | None) -> int:
    min_tokens = fields.integer("min_tokens", low=0, high=MAX_INT32) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid_request(
            f"Invalid 'min_tokens': {min_tokens} is more than max_tokens ({max_tokens}).",
            param="min_tokens",
        )
    return min_tokens


def top_p(fields: Fields) -> float | None:
    """In (0, 1]: nucleus sampling keeps the fewest tokens whose probabilities add up to
    ``top_p``, and at 0 that is no token (the worker refuses it, as vLLM does)."""
    value = fields.number("top_p", low=0, high=1)
    if value == 0:
        raise invalid_request(
            "Invalid 'top_p': expected a value > 0 and <= 1, but got 0 instead (for the "
            "most likely token every time, send temperature 0).",
            param="top_p",
            code="invalid_value",
        )
    return value


def repetition_penalty(fields: Fields) -> float:
    value = fields.number("repetition_penalty")
    if value is None:
        return 1.0
    if not value > 0 or value == float("inf"):
        raise invalid_request(
            f"Invalid 'repetition_penalty': expected a value > 0 (1 disables it), but got "
            f"{value} instead.",
            param="repetition_penalty",
            code="invalid_value",
        )
    return value
