"""The gateway's OpenAPI 3.1 description, served at ``/openapi.json``.

Written by hand because the routes read their bodies themselves (protocol/requests.py):
FastAPI sees no body parameters to describe. It states what the parsers accept, which is
narrower than OpenAI's API in places: a feature kvflow cannot honour accepts only its
harmless values (``tools: []``, ``suffix: ""``), every optional parameter may be
null (it then means "absent"), and an unknown parameter is refused (no
``additionalProperties``). Rules across fields are stated where JSON Schema can say them
(``stream_options`` needs ``stream: true``); the others are the gateway's alone and answer
400: ``best_of`` equals ``n``, ``min_tokens`` is at most ``max_tokens``, a prompt fits the
context, ``logit_bias`` ids are in the vocabulary.

tests/fuzz/ drives schemathesis from this document against a real gateway: a parameter
the parsers learn must be added here, or the fuzzer's invalid bodies (which may carry it
as an unknown property) are accepted and it fails.
"""

from __future__ import annotations

from typing import Any

from kvflow.router.api.openapi_batch import batch_paths, batch_schemas
from kvflow.router.api.openapi_requests import chat_request, completion_request, integer
from kvflow.router.api.openapi_responses import (
    INPUT_ITEM_LIST,
    RESPONSE_OBJECT,
    response_request,
    responses_paths,
)
from kvflow.router.protocol.limits import DEFAULT_LIMITS, RequestLimits

Schema = dict[str, Any]
_REF = "#/components/schemas/"


_ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {k: integer(0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
}
_FINISH = {"enum": ["stop", "length", "tool_calls", "abort", None]}
_CHAT_CHOICE: Schema = {
    "type": "object",
    "required": ["index", "message", "finish_reason"],
    "properties": {
        "index": integer(0),
        "message": {
            "type": "object",
            "required": ["role", "content"],
            # content is null when the answer is tool calls only
            "properties": {
                "role": {"const": "assistant"},
                "content": {"type": ["string", "null"]},
                "tool_calls": {"type": "array"},
            },
        },
        "logprobs": {"type": ["object", "null"]},
        "finish_reason": _FINISH,
    },
}
_TEXT_CHOICE: Schema = {
    "type": "object",
    "required": ["index", "text", "finish_reason"],
    "properties": {
        "index": integer(0),
        "text": {"type": "string"},
        "logprobs": {"type": ["object", "null"]},
        "finish_reason": _FINISH,
    },
}


def _completion(kind: str, choice: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": integer(0),
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice, "minItems": 1},
            "usage": _USAGE,
        },
    }


_TOKENS: Schema = {"type": "array", "minItems": 1, "items": integer(0, 2**31 - 1)}
_EMBEDDING_RESPONSE: Schema = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": integer(0),
                    # floats, or base64 of little-endian float32 (encoding_format)
                    "embedding": {"type": ["array", "string"], "items": {"type": "number"}},
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {k: integer(0) for k in ("prompt_tokens", "total_tokens")},
        },
    },
}


def _embedding_request(served_models: list[str]) -> Schema:
    """What protocol/embeddings.py parses; `dimensions` and the number of inputs are the
    model's (400 past them), as is the length of each input."""
    text = {"type": "string", "minLength": 1}
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": {
            "model": {"type": "string", "enum": served_models}
            if served_models
            else {"type": "string"},
            "input": {
                "anyOf": [
                    text,
                    {"type": "array", "minItems": 1, "items": text},
                    _TOKENS,
                    {"type": "array", "minItems": 1, "items": _TOKENS},
                ]
            },
            "encoding_format": {"enum": ["float", "base64", None]},
            "dimensions": {"anyOf": [integer(1, 2**31 - 1), {"type": "null"}]},
            "user": {"type": ["string", "null"]},
        },
        "additionalProperties": False,
    }


def _embeddings() -> Schema:
    return {
        "post": {
            "operationId": "Embedding",
            "summary": "Embeddings of texts or token arrays",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF + "EmbeddingRequest"}}},
            },
            "responses": {
                "200": _json({"$ref": _REF + "EmbeddingResponse"}, "One vector per input"),
                **_errors("400", "401", "403", "404", "413", "429", "502", "503"),
            },
        }
    }


_SSE_EVENT: Schema = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"const": "message"}},
}
_MODEL_CARD: Schema = {
    "type": "object",
    "required": ["id", "object", "created", "owned_by"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "model"},
        "created": integer(0),
        "owned_by": {"type": "string"},
    },
}

_ERRORS = {
    "400": "Invalid request: a malformed body, a bad parameter, a prompt past the context.",
    "401": "No API key, or an unknown one (only when tenants are configured).",
    "403": "This API key may not use this model.",
    "404": "No such model is served.",
    "413": "The body is larger than limits.max_body_bytes.",
    "429": "A tenant quota is spent; Retry-After says when to come back.",
    "502": "A worker failed and no retry succeeded.",
    "503": "No worker is available; Retry-After says when to come back.",
}
_RETRY_AFTER = {"Retry-After": {"schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def _json(schema: Schema, description: str, headers: Schema | None = None) -> Schema:
    response: Schema = {
        "description": description,
        "content": {"application/json": {"schema": schema}},
    }
    if headers:
        response["headers"] = headers
    return response


def _errors(*codes: str) -> Schema:
    return {
        code: _json(
            {"$ref": _REF + "Error"},
            _ERRORS[code],
            _RETRY_AFTER if code in ("429", "503") else None,
        )
        for code in codes
    }


def _generation(name: str, summary: str, result: str) -> Schema:
    return {
        "post": {
            "operationId": name,
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": _REF + name + "Request"}}},
            },
            "responses": {
                "200": {
                    "description": "The completion; with stream: true, server-sent events.",
                    "content": {
                        "application/json": {"schema": {"$ref": _REF + result}},
                        # One server-sent event: `data` holds a chunk's JSON, or [DONE].
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                **_errors("400", "401", "403", "404", "413", "429", "502", "503"),
            },
        }
    }


def _get(name: str, response: Schema, *errors: str, params: list[Schema] | None = None) -> Schema:
    operation: Schema = {"operationId": name, "responses": {"200": response, **_errors(*errors)}}
    if params:
        operation["parameters"] = params
    return {"get": operation}


def build_openapi(
    *, served_models: list[str], vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS
) -> Schema:
    """The document for a gateway serving ``served_models`` with a tokenizer of
    ``vocab_size`` ids, under its configured request ``limits``. Pure; called on every GET
    /openapi.json, since the served models can change as workers come and go."""
    model_list = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _MODEL_CARD},
        },
    }
    usage = {
        "type": "object",
        "required": ["object", "tenant", "scope"],
        "properties": {
            "object": {"const": "usage"},
            "tenant": {"type": "string"},
            "scope": {"enum": ["cluster", "replica"]},
            **{
                k: integer(0)
                for k in ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")
            },
        },
    }
    ready = {
        "type": "object",
        "required": ["ready", "workers_healthy", "workers"],
        "properties": {
            "ready": {"type": "boolean"},
            "workers_healthy": integer(0),
            "workers": integer(0),
        },
    }
    model_param = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    text = {
        "description": "Prometheus text format",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvflow gateway",
            "version": "1",
            "description": "OpenAI-compatible; see docs/router.md for what is supported.",
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "ChatCompletion", "Chat completion", "ChatCompletionResponse"
            ),
            "/v1/completions": _generation("Completion", "Text completion", "CompletionResponse"),
            "/v1/embeddings": _embeddings(),
            "/v1/models": _get("ListModels", _json(model_list, "Served models"), "401"),
            "/v1/models/{model}": _get(
                "GetModel",
                _json(_MODEL_CARD, "One model"),
                "401",
                "403",
                "404",
                "503",
                params=[model_param],
            ),
            "/v1/usage": _get("Usage", _json(usage, "The caller's token totals"), "401"),
            "/health": _get("Health", _json({"type": "object"}, "The process is up")),
            "/ready": {
                "get": {
                    "operationId": "Ready",
                    "responses": {
                        "200": _json(ready, "At least one worker is healthy"),
                        "503": _json(ready, "No worker is healthy"),
                    },
                }
            },
            "/metrics": _get("Metrics", text),
            **batch_paths(),  # /v1/files, /v1/batches
            **responses_paths(_errors("400", "401", "403", "404", "413", "429", "502", "503")),
        },
        "components": {
            "schemas": {
                "Error": _ERROR,
                "ChatCompletionRequest": chat_request(served_models, limits),
                "CompletionRequest": completion_request(served_models, vocab_size, limits),
                "ChatCompletionResponse": _completion("chat.completion", _CHAT_CHOICE),
                "CompletionResponse": _completion("text_completion", _TEXT_CHOICE),
                **batch_schemas(),
                "ResponseRequest": response_request(served_models),
                "Response": RESPONSE_OBJECT,
                "ResponseItemList": INPUT_ITEM_LIST,
                "EmbeddingRequest": _embedding_request(served_models),
                "EmbeddingResponse": _EMBEDDING_RESPONSE,
            }
        },
    }
