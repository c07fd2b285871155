"""Request bodies of the OpenAI endpoints, as JSON Schema (for api/openapi.py).

They state what protocol/requests.py and messages.py accept (see api/openapi.py on where
the two may drift), with this gateway's request limits (--max-n and the like) as they are
configured, not their defaults. Pure.
"""

from __future__ import annotations

from typing import Any

from kvflow.router.protocol.limits import DEFAULT_LIMITS, RequestLimits
from kvflow.router.protocol.requests import MAX_LOGPROBS_COMPLETIONS, MAX_TOP_LOGPROBS_CHAT
from kvflow.router.protocol.sampling_fields import MAX_LOGIT_BIAS, MAX_PENALTY
from kvflow.router.tools.spec import MAX_TOOLS

Schema = dict[str, Any]

EMPTY: Schema = {
    "anyOf": [{"type": "array", "maxItems": 0}, {"type": "object", "maxProperties": 0}]
}


def opt(schema: Schema) -> Schema:
    """An optional parameter: null reads as absent."""
    return {"anyOf": [schema, {"type": "null"}]}


def integer(low: int | None = None, high: int | None = None) -> Schema:
    bounds = {"minimum": low, "maximum": high}
    return {"type": "integer", **{k: v for k, v in bounds.items() if v is not None}}


def _num(low: float, high: float) -> Schema:
    return {"type": "number", "minimum": low, "maximum": high}


def only(*values: object) -> Schema:
    """A parameter kvflow does not support: only these values (or an empty one) pass."""
    return opt({"anyOf": [{"enum": list(values)}, EMPTY]} if values else EMPTY)


BOOL = opt({"type": "boolean"})
_ANY: Schema = {}  # accepted and ignored (user, metadata...)
# priority_class and service_tier are read by the gateway (protocol/priority_class.py).
_IGNORED = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
            "priority_class")  # fmt: skip


def _sampling(*, is_chat: bool, limits: RequestLimits) -> Schema:
    stop_string = {"type": "string", "minLength": 1}
    props: Schema = {
        "max_tokens": opt(integer(1)),
        "max_completion_tokens": opt(integer(1)),
        "temperature": opt(_num(0, 2)),
        "top_p": opt(_num(0, 1)),
        "top_k": opt(integer(0)),
        "min_p": opt(_num(0, 1)),
        "seed": opt(integer(-(2**63), 2**64 - 1)),
        "stop": opt(
            {
                "anyOf": [
                    stop_string,
                    {"type": "array", "items": stop_string, "maxItems": limits.max_stop_strings},
                ]
            }
        ),
        "stop_token_ids": opt({"type": "array", "items": integer(0)}),
        "n": opt(integer(1, limits.max_n)),
        "ignore_eos": BOOL,
        "include_stop_str_in_output": BOOL,
        "skip_special_tokens": BOOL,
        "frequency_penalty": opt(_num(-MAX_PENALTY, MAX_PENALTY)),
        "presence_penalty": opt(_num(-MAX_PENALTY, MAX_PENALTY)),
        # vLLM's: > 0, 1 disables it.
        "repetition_penalty": opt({"type": "number", "exclusiveMinimum": 0}),
        "min_tokens": opt(integer(0)),  # at most max_tokens (a 400 otherwise)
        # Token ids (decimal keys) below the vocabulary size (a 400 otherwise).
        "logit_bias": opt(
            {
                "type": "object",
                "maxProperties": limits.max_logit_bias_entries,
                "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": _num(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS),
            }
        ),
        "stream": BOOL,
        "stream_options": opt(
            {
                "type": "object",
                "properties": {
                    "include_usage": BOOL,
                    "include_obfuscation": BOOL,
                    "continuous_usage_stats": BOOL,
                },
                "additionalProperties": False,
            }
        ),
        **dict.fromkeys(_IGNORED, _ANY),
    }
    if is_chat:
        props["logprobs"] = BOOL
        props["top_logprobs"] = opt(integer(0, MAX_TOP_LOGPROBS_CHAT))
    else:
        props["logprobs"] = opt(integer(0, MAX_LOGPROBS_COMPLETIONS))
    return props


def _when(condition: Schema, then: Schema) -> Schema:
    """A rule across fields: if the body matches ``condition`` it must match ``then``."""
    return {"if": condition, "then": then}


def _present(name: str, schema: Schema) -> Schema:
    return {"required": [name], "properties": {name: schema}}


# stream_options only with stream: true (a 400 otherwise).
_STREAM_OPTIONS_NEED_STREAM = _when(
    _present("stream_options", {"type": "object"}), _present("stream", {"const": True})
)


def _model(served_models: list[str]) -> Schema:
    # Any string is read; one that is not served answers 404, listed below.
    return {"type": "string", "enum": served_models} if served_models else {"type": "string"}


def _object(**props: Schema) -> Schema:
    return {"type": "object", "required": sorted(props), "properties": props}


# OpenAI's rule for function and json_schema names.
NAME: Schema = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_NON_EMPTY: Schema = {"type": "string", "minLength": 1}
# `parameters` and `schema` must be JSON Schemas that llguidance compiles (a 400 otherwise).
_TOOL = _object(
    type={"const": "function"},
    function={
        **_object(name=NAME),
        "properties": {
            "name": NAME,
            "description": opt({"type": "string"}),
            "parameters": opt({"type": "object"}),
            "strict": opt({"type": "boolean"}),
        },
    },
)
_NAMED_CHOICE = _object(type={"const": "function"}, function=_object(name={"type": "string"}))
_TOOL_CALL: Schema = {
    "type": "object",
    "required": ["id", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": _object(name={"type": "string"}, arguments={"type": "string"}),
    },
}
_JSON_SCHEMA_FORMAT = _object(
    type={"const": "json_schema"},
    json_schema={
        **_object(name=NAME),
        "additionalProperties": False,
        "properties": {
            "name": NAME,
            "description": _ANY,
            "schema": opt({"type": "object"}),
            "strict": opt({"type": "boolean"}),
        },
    },
)


def chat_request(served_models: list[str], limits: RequestLimits = DEFAULT_LIMITS) -> Schema:
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    }
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    # OpenAI's rule: content may be null or absent only on an assistant message with calls.
    calls_tools = {
        "required": ["role", "tool_calls"],
        "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array",
                                                                       "minItems": 1}},
    }  # fmt: skip
    message = {
        "type": "object",
        "required": ["role"],
        "properties": {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": opt(content),
            "name": opt({"type": "string"}),
            "tool_calls": opt({"type": "array", "items": _TOOL_CALL}),  # assistant only
            "tool_call_id": opt({"type": "string"}),
        },
        "allOf": [
            _when(
                _present("role", {"const": "tool"}), _present("tool_call_id", {"type": "string"})
            ),
            _when({"not": calls_tools}, _present("content", content)),
        ],
    }
    props = {
        "model": _model(served_models),
        "messages": {"type": "array", "items": message, "minItems": 1},
        **_sampling(is_chat=True, limits=limits),
        **{
            name: only()
            for name in (
                "functions",
                "audio",
                "prediction",
                "web_search_options",
                "reasoning_effort",
            )
        },
        "tools": opt({"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}),
        "tool_choice": opt({"anyOf": [{"enum": ["none", "auto", "required"]}, _NAMED_CHOICE]}),
        "parallel_tool_calls": BOOL,
        "function_call": only("none"),
        "modalities": only(["text"]),
        "response_format": opt(
            {"anyOf": [_object(type={"enum": ["text", "json_object"]}), _JSON_SCHEMA_FORMAT]}
        ),
        # kvflow's extension: exactly one of these (a 400 otherwise).
        "structured_outputs": opt(
            {
                "type": "object",
                "minProperties": 1,
                "additionalProperties": False,
                "properties": {
                    "json": opt({"type": ["object", "string"]}),
                    "regex": opt(_NON_EMPTY),
                    "grammar": opt(_NON_EMPTY),
                    "json_object": opt({"type": "boolean"}),
                    "choice": opt({"type": "array", "items": {"type": "string"}, "minItems": 1}),
                },
            }
        ),
        "chat_template_kwargs": opt(
            {
                "type": "object",
                "not": {
                    "anyOf": [
                        {"required": [k]}
                        for k in ("messages", "add_generation_prompt", "bos_token", "eos_token")
                    ]
                },
            }
        ),
        "add_generation_prompt": BOOL,
        "continue_final_message": only(False),
        "echo": only(False),
    }
    return {
        "type": "object",
        "required": ["model", "messages"],
        "properties": props,
        "additionalProperties": False,
        "allOf": [
            _STREAM_OPTIONS_NEED_STREAM,
            _when(_present("top_logprobs", integer(1)), _present("logprobs", {"const": True})),
        ],
    }


def completion_request(
    served_models: list[str], vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS
) -> Schema:
    token_ids = {"type": "array", "items": integer(0, vocab_size - 1), "minItems": 1}
    prompt = {
        "anyOf": [
            # "" tokenizes to nothing: "The prompt is empty", a 400.
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1},
        ]
    }
    props = {
        "model": _model(served_models),
        "prompt": prompt,
        **_sampling(is_chat=False, limits=limits),
        "echo": BOOL,
        "suffix": only(""),
        "best_of": opt(integer(1)),
    }
    return {
        "type": "object",
        "required": ["model", "prompt"],
        "properties": props,
        "additionalProperties": False,
        "allOf": [
            _STREAM_OPTIONS_NEED_STREAM,
            # echo with logprobs is refused
            _when(
                _present("logprobs", {"type": "integer"}),
                {"properties": {"echo": {"not": {"const": True}}}},
            ),
        ],
    }
