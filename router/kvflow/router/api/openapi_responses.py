"""The Responses API's part of the OpenAPI document (api/openapi.py): its request, exactly
the parameters protocol/responses_api.py reads (tests/fuzz/test_openapi_schema.py checks
it), the Response it answers, and the routes of stored Responses."""

from __future__ import annotations

from typing import Any

from kvflow.router.api.openapi_requests import BOOL, NAME, integer, only, opt
from kvflow.router.protocol.input_items import DEFAULT_LIMIT, MAX_LIMIT
from kvflow.router.protocol.responses_api import LOGPROBS_INCLUDE, MAX_TOP_LOGPROBS
from kvflow.router.tools.spec import MAX_TOOLS

Schema = dict[str, Any]
_REF = "#/components/schemas/"


def _object(required: tuple[str, ...], **props: Schema) -> Schema:
    return {"type": "object", "required": list(required), "properties": props}


_TEXT_PART = _object(("type", "text"), type={"enum": ["input_text", "output_text"]},
                     text={"type": "string"})  # fmt: skip
_MESSAGE = _object(
    ("role", "content"),
    type={"const": "message"},
    role={"enum": ["user", "system", "developer", "assistant"]},
    content={"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
)
_CALL = _object(("type", "call_id", "name", "arguments"), type={"const": "function_call"},
                call_id={"type": "string"}, name={"type": "string"},
                arguments={"type": "string"})  # fmt: skip
_CALL_OUTPUT = _object(
    ("type", "call_id", "output"),
    type={"const": "function_call_output"},
    call_id={"type": "string"},
    output={"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]},
)
_TOOL = _object(("type", "name"), type={"const": "function"}, name=NAME,
                description=opt({"type": "string"}), parameters=opt({"type": "object"}),
                strict=opt({"type": "boolean"}))  # fmt: skip
_FORMAT = {
    "anyOf": [
        _object(("type",), type={"enum": ["text", "json_object"]}),
        _object(("type", "name"), type={"const": "json_schema"}, name=NAME,
                schema=opt({"type": "object"}), strict=opt({"type": "boolean"}),
                description=opt({"type": "string"})),
    ]
}  # fmt: skip


def response_request(served_models: list[str]) -> Schema:
    """``POST /v1/responses``'s body."""
    model = {"type": "string", "enum": served_models} if served_models else {"type": "string"}
    props: Schema = {
        "model": model,
        "input": {
            "anyOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "minItems": 1,
                    "items": {"anyOf": [_MESSAGE, _CALL, _CALL_OUTPUT]},
                },
            ]
        },
        "instructions": opt({"type": "string"}),
        "max_output_tokens": opt(integer(1)),
        "temperature": opt({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": opt({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "stream": BOOL,
        "stream_options": opt(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {"include_obfuscation": {"type": "boolean"}},
            }
        ),
        "tools": opt({"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}),
        "tool_choice": opt(
            {
                "anyOf": [
                    {"enum": ["none", "auto", "required"]},
                    _object(("type", "name"), type={"const": "function"}, name={"type": "string"}),
                ]
            }
        ),
        "parallel_tool_calls": BOOL,
        "text": opt(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {"format": opt(_FORMAT), "verbosity": {"type": "null"}},
            }
        ),
        "metadata": opt({"type": "object"}),
        "include": opt({"type": "array", "items": {"const": LOGPROBS_INCLUDE}}),
        "top_logprobs": opt(integer(0, MAX_TOP_LOGPROBS)),
        "store": BOOL,  # default true: kept for previous_response_id and GET
        "previous_response_id": opt({"type": "string", "minLength": 1}),
        "background": only(False),
        "truncation": only("disabled"),
        "reasoning": opt(
            {
                "type": "object",
                "additionalProperties": False,
                "properties": {"effort": {"type": "null"}, "summary": {"type": "null"}},
            }
        ),
        **{
            name: only()
            for name in (
                "conversation",
                "prompt",
                "max_tool_calls",
                "context_management",
            )
        },
        **{
            name: {}
            for name in (
                "user",
                "safety_identifier",
                "prompt_cache_key",
                "service_tier",
                "priority_class",
            )
        },
    }
    return {
        "type": "object",
        "required": ["model", "input"],
        "properties": props,
        "additionalProperties": False,
        "allOf": [{"if": {"required": ["stream_options"],
                          "properties": {"stream_options": {"type": "object"}}},
                   "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}],
    }  # fmt: skip


_OUTPUT_TEXT = _object(("type", "text", "annotations"), type={"const": "output_text"},
                       text={"type": "string"}, annotations={"type": "array"})  # fmt: skip
RESPONSE_OBJECT: Schema = _object(
    ("id", "object", "created_at", "status", "model", "output", "usage", "store"),
    id={"type": "string", "pattern": "^resp_"},
    object={"const": "response"},
    created_at=integer(0),
    status={"enum": ["completed", "incomplete", "failed", "in_progress"]},
    incomplete_details=opt(
        _object(("reason",), reason={"enum": ["max_output_tokens", "content_filter"]})
    ),
    model={"type": "string"},
    output={
        "type": "array",
        "items": {
            "anyOf": [
                _object(
                    ("type", "id", "role", "content"),
                    type={"const": "message"},
                    id={"type": "string"},
                    role={"const": "assistant"},
                    content={"type": "array", "items": _OUTPUT_TEXT},
                ),
                _object(
                    ("type", "id", "call_id", "name", "arguments"),
                    type={"const": "function_call"},
                    id={"type": "string"},
                    call_id={"type": "string"},
                    name={"type": "string"},
                    arguments={"type": "string"},
                ),
            ]
        },
    },
    usage=opt(
        _object(
            ("input_tokens", "output_tokens", "total_tokens"),
            input_tokens=integer(0),
            output_tokens=integer(0),
            total_tokens=integer(0),
        )
    ),
    store={"type": "boolean"},
    previous_response_id=opt({"type": "string"}),
)


_INPUT_PART = _object(("type", "text"), type={"enum": ["input_text", "output_text"]},
                     text={"type": "string"})  # fmt: skip
# GET /v1/responses/{id}/input_items: a page of the request's input (protocol/input_items.py).
INPUT_ITEM_LIST: Schema = _object(
    ("object", "data", "first_id", "last_id", "has_more"),
    object={"const": "list"},
    data={"type": "array", "maxItems": MAX_LIMIT, "items": {"anyOf": [
        _object(("id", "type", "role", "content", "status"), id={"type": "string"},
                type={"const": "message"}, role={"enum": ["user", "system", "developer",
                                                          "assistant"]},
                content={"type": "array", "items": _INPUT_PART}, status={"const": "completed"}),
        _object(("id", "type", "call_id", "name", "arguments", "status"), id={"type": "string"},
                type={"const": "function_call"}, call_id={"type": "string"},
                name={"type": "string"}, arguments={"type": "string"},
                status={"const": "completed"}),
        _object(("id", "type", "call_id", "output", "status"), id={"type": "string"},
                type={"const": "function_call_output"}, call_id={"type": "string"},
                output={"anyOf": [{"type": "string"}, {"type": "array",
                                                        "items": _INPUT_PART}]},
                status={"const": "completed"}),
    ]}},
    first_id=opt({"type": "string"}),
    last_id=opt({"type": "string"}),
    has_more={"type": "boolean"},
)  # fmt: skip


# One server-sent event: its name is the event's type, `data` the event's JSON.
_SSE_EVENT: Schema = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {"data": {"type": "string"}, "event": {"pattern": "^(response[.].+|error)$"}},
}


def _json_of(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def responses_paths(errors: Schema) -> Schema:
    """The routes, with the document's error responses."""
    response_id = {"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string"}}  # fmt: skip
    deleted = _object(("id", "object", "deleted"), id={"type": "string"},
                      object={"const": "response"}, deleted={"const": True})  # fmt: skip
    stored = {"parameters": [response_id]}
    return {
        "/v1/responses": {"post": {
            "operationId": "CreateResponse",
            "summary": "A Response (OpenAI's Responses API), answered on the chat path",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": _REF + "ResponseRequest"}}}},
            "responses": {
                "200": {"description": "The Response; with stream: true, its events.",
                        "content": {"application/json": {"schema": {"$ref": _REF + "Response"}},
                                    "text/event-stream": {"schema": _SSE_EVENT}}},
                **errors,
            },
        }},
        "/v1/responses/{response_id}": {
            "get": {"operationId": "GetResponse", **stored, "responses": {
                "200": _json_of({"$ref": _REF + "Response"}, "The stored Response"),
                "401": errors["401"], "404": errors["404"]}},
            "delete": {"operationId": "DeleteResponse", **stored, "responses": {
                "200": _json_of(deleted, "Deleted"),
                "401": errors["401"], "404": errors["404"]}},
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            "operationId": "ListInputItems",
            "summary": "The stored Response's request input, a page of items",
            "parameters": [response_id, *_LIST_PARAMETERS],
            "responses": {
                "200": _json_of({"$ref": _REF + "ResponseItemList"}, "A page of input items"),
                "400": errors["400"], "401": errors["401"], "404": errors["404"],
                "503": errors["503"]},
        }},
    }  # fmt: skip


_LIST_PARAMETERS: list[Schema] = [
    {"name": "limit", "in": "query", "required": False,
     "schema": integer(1, MAX_LIMIT) | {"default": DEFAULT_LIMIT}},
    {"name": "order", "in": "query", "required": False,
     "schema": {"enum": ["asc", "desc"], "default": "desc"}},
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"},
     "description": "An item id of this response: the page starts after it (400 if none)."},
    {"name": "include", "in": "query", "required": False,
     "schema": {"type": "array", "items": {"const": LOGPROBS_INCLUDE}}},
]  # fmt: skip
