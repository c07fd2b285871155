"""The Batch API's part of ``/openapi.json`` (batch/routes.py; docs/router.md, "Batch API"):
OpenAI's file and batch objects as this gateway returns them."""

from __future__ import annotations

from typing import Any

from kvflow.router.batch.listing import BATCHES, FILES
from kvflow.router.batch.records import COMPLETION_WINDOWS, ENDPOINTS, Status

Schema = dict[str, Any]
_REF = "#/components/schemas/"
_NULLABLE_INT: Schema = {"type": ["integer", "null"]}
_NULLABLE_STR: Schema = {"type": ["string", "null"]}
_WHY = {
    "400": "The request is not a valid upload or batch.",
    "401": "The API key is missing or wrong.",
    "404": "No such file or batch for this tenant, or the Batch API is off.",
    "409": "The batch cannot be cancelled in its status, or the file is a running batch's.",
    "413": "The file is larger than --batch-max-file-bytes.",
    "503": "The files and batches store (Redis, the directory) failed; retry after Retry-After.",
}

FILE: Schema = {
    "type": "object",
    "required": ["id", "object", "bytes", "created_at", "filename", "purpose", "status"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "file"},
        "bytes": {"type": "integer", "minimum": 0},
        "created_at": {"type": "integer"},
        "filename": {"type": "string"},
        "purpose": {"enum": ["batch", "batch_output"]},
        "status": {"const": "processed"},
        "expires_at": _NULLABLE_INT,
        "status_details": _NULLABLE_STR,
    },
}
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
           "cancelling_at", "cancelled_at")  # fmt: skip
BATCH: Schema = {
    "type": "object",
    "required": [
        "id",
        "object",
        "endpoint",
        "input_file_id",
        "completion_window",
        "status",
        "created_at",
        "request_counts",
    ],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "batch"},
        "endpoint": {"enum": list(ENDPOINTS)},
        "input_file_id": {"type": "string"},
        "completion_window": {"enum": list(COMPLETION_WINDOWS)},
        "status": {"enum": [str(s) for s in Status]},
        "created_at": {"type": "integer"},
        "expires_at": _NULLABLE_INT,
        "output_file_id": _NULLABLE_STR,
        "error_file_id": _NULLABLE_STR,
        "errors": {"type": ["object", "null"]},
        "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
        "request_counts": {
            "type": "object",
            "required": ["total", "completed", "failed"],
            "properties": {
                k: {"type": "integer", "minimum": 0} for k in ("total", "completed", "failed")
            },
        },
        **{stamp: _NULLABLE_INT for stamp in _STAMPS},
    },
}
CREATE_BATCH: Schema = {
    "type": "object",
    "required": ["input_file_id", "endpoint", "completion_window"],
    "properties": {
        "input_file_id": {"type": "string"},
        "endpoint": {"enum": list(ENDPOINTS)},
        "completion_window": {"enum": list(COMPLETION_WINDOWS)},
        "metadata": {
            "type": ["object", "null"],
            "additionalProperties": {"type": "string"},
            "maxProperties": 16,
        },
    },
}


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _responses(ok: Schema, *errors: str) -> Schema:
    return {"200": ok, **{c: _json({"$ref": _REF + "Error"}, _WHY[c]) for c in errors}}


def _list(item: str) -> Schema:
    return {"type": "object", "required": ["object", "data"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": {"$ref": _REF + item}}}}  # fmt: skip


def _id(name: str) -> list[Schema]:
    return [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}]


def _page_parameters(max_limit: int, *, files: bool) -> list[Schema]:
    """The listings' query (batch/listing.py)."""
    found: list[Schema] = [
        {"name": "limit", "in": "query", "required": False,
         "schema": {"type": "integer", "minimum": 1, "maximum": max_limit}},
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    ]  # fmt: skip
    if files:
        found += [
            {"name": "order", "in": "query", "required": False,
             "schema": {"enum": ["asc", "desc"]}},
            {"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}},
        ]  # fmt: skip
    return found


def batch_paths() -> Schema:
    file_ref, batch_ref = {"$ref": _REF + "File"}, {"$ref": _REF + "Batch"}
    upload = {
        "type": "object",
        "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"const": "batch"}},
    }  # fmt: skip
    content = {"description": "The file's bytes (JSONL)",
               "content": {"application/jsonl": {"schema": {"type": "string"}}}}  # fmt: skip
    deleted = {"type": "object", "required": ["id", "object", "deleted"],
               "properties": {"id": {"type": "string"}, "object": {"const": "file"},
                              "deleted": {"type": "boolean"}}}  # fmt: skip
    return {
        "/v1/files": {
            "post": {"operationId": "UploadFile",
                     "requestBody": {"required": True, "content": {
                         "multipart/form-data": {"schema": upload}}},
                     "responses": _responses(_json(file_ref, "The stored file"),
                                             "400", "401", "404", "413")},
            "get": {"operationId": "ListFiles",
                    "parameters": _page_parameters(FILES.max_limit, files=True),
                    "responses": _responses(_json(_list("File"), "The tenant's files"),
                                            "400", "401", "404", "503")},
        },
        "/v1/files/{file_id}": {
            "get": {"operationId": "GetFile", "parameters": _id("file_id"),
                    "responses": _responses(_json(file_ref, "The file"), "401", "404")},
            "delete": {"operationId": "DeleteFile", "parameters": _id("file_id"),
                       "responses": _responses(_json(deleted, "Deleted"), "401", "404", "409")},
        },
        "/v1/files/{file_id}/content": {
            "get": {"operationId": "GetFileContent", "parameters": _id("file_id"),
                    "responses": _responses(content, "401", "404")},
        },
        "/v1/batches": {
            "post": {"operationId": "CreateBatch",
                     "requestBody": {"required": True, "content": {
                         "application/json": {"schema": {"$ref": _REF + "CreateBatchRequest"}}}},
                     "responses": _responses(_json(batch_ref, "The new batch"),
                                             "400", "401", "404", "413")},
            "get": {"operationId": "ListBatches",
                    "parameters": _page_parameters(BATCHES.max_limit, files=False),
                    "responses": _responses(_json(_list("Batch"), "The tenant's batches"),
                                            "400", "401", "404", "503")},
        },
        "/v1/batches/{batch_id}": {
            "get": {"operationId": "GetBatch", "parameters": _id("batch_id"),
                    "responses": _responses(_json(batch_ref, "The batch"), "401", "404")},
        },
        "/v1/batches/{batch_id}/cancel": {
            "post": {"operationId": "CancelBatch", "parameters": _id("batch_id"),
                     "responses": _responses(_json(batch_ref, "The batch, cancelling"),
                                             "401", "404", "409")},
        },
    }  # fmt: skip


def batch_schemas() -> Schema:
    return {"File": FILE, "Batch": BATCH, "CreateBatchRequest": CREATE_BATCH}
