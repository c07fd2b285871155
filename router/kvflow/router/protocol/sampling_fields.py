"""Parse the sampling fields of a request body that need more than a type and a range.

Pure: no I/O. Each function takes the body's ``Fields`` and returns a plain value or raises
the OpenAI-style 400 that names the field; ``requests`` assembles them into SamplingOptions.
"""

from __future__ import annotations

from kvflow.router.protocol.errors import invalid_request
from kvflow.router.protocol.fields import Fields, as_mapping, invalid_type

MAX_INT32 = 2**31 - 1  # the worker's SamplingParams holds these counts as int32
MAX_STOP_STRINGS = 4  # OpenAI's limit for `stop`
MAX_PENALTY = 2  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100  # OpenAI's range for one bias: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit


def stop_strings(fields: Fields) -> tuple[str, ...]:
    value = fields.raw("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid_request(
            f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}.",
            param="stop",
        )
    if any(s == "" for s in stops):
        raise invalid_request("Invalid 'stop': stop strings must not be empty.", param="stop")
    return tuple(stops)


def stop_token_ids(fields: Fields) -> tuple[int, ...]:
    value = fields.raw("stop_token_ids")
    if value is None:
        return ()
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


def logit_bias(fields: Fields) -> tuple[tuple[int, float], ...]:
    value = fields.raw("logit_bias")
    if value is None:
        return ()
    biases = as_mapping(value, "logit_bias")
    if len(biases) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid_request(
            f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(biases)}.",
            param="logit_bias",
        )
    pairs: dict[int, float] = {}
    for key, bias in biases.items():
        # JSON object keys are strings; OpenAI takes decimal token ids.
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
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
