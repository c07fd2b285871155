"""`/v1/files` and `/v1/batches`, OpenAI's shapes. A tenant sees only its own files and
batches: another's id is a 404, as an id that never existed."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import read_json_body
from kvflow.router.batch.config import BatchConfig
from kvflow.router.batch.listing import BATCHES, FILES, list_object, page, page_query
from kvflow.router.batch.multipart import MultipartError, boundary_of, parse_multipart
from kvflow.router.batch.records import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    FILE_PURPOSE,
    BatchRecord,
    FileRecord,
    Status,
    new_id,
)
from kvflow.router.batch.store import BatchStore, with_counts
from kvflow.router.protocol.errors import ApiError, invalid_request
from kvflow.router.store_errors import STORE_ERRORS
from kvflow.router.tenants.config import Tenant

log = logging.getLogger("kvflow.router.batch")
P = ParamSpec("P")
T = TypeVar("T")

ENDPOINT_PATHS = ("/v1/files", "/v1/batches")
# Room for the multipart framing and the purpose field around the file itself.
_MULTIPART_OVERHEAD_BYTES = 64 * 1024
MAX_METADATA_KEYS = 16
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _is_id(text: str) -> bool:
    """Shaped as the ids this gateway makes (records.new_id): anything else names nothing,
    and never reaches a store's paths or keys."""
    return _ID.fullmatch(text) is not None


def _not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No {kind} found with id '{object_id}'.", code="not_found")


def _file_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The file is larger than this gateway accepts ({limit} bytes, "
                    "--batch-max-file-bytes).", code="file_too_large")  # fmt: skip


async def _read_upload(request: Request, limit: int) -> bytes:
    allowed = limit + _MULTIPART_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > allowed:
        raise _file_too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > allowed:
            raise _file_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _query(request: Request) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, value in request.query_params.multi_items():
        found.setdefault(name, []).append(value)
    return found


class BatchApi:
    def __init__(self, gateway: Gateway, store: BatchStore, config: BatchConfig) -> None:
        self.gw, self.store, self.config = gateway, store, config

    async def own_file(self, tenant: Tenant, file_id: str) -> FileRecord:
        record = await self.store.get_file(file_id) if _is_id(file_id) else None
        if record is None or record.tenant != tenant.name:
            raise _not_found("file", file_id)
        return record

    async def own_batch(self, tenant: Tenant, batch_id: str) -> BatchRecord:
        record = await self.store.get_batch(batch_id) if _is_id(batch_id) else None
        if record is None or record.tenant != tenant.name:
            raise _not_found("batch", batch_id)
        return record

    async def view(self, record: BatchRecord) -> dict[str, Any]:
        """As the client sees it: a cancel asked for shows at once, before the runner acts.
        An ended batch's counts are its record's: its lines' results are dropped then."""
        if record.status in (Status.VALIDATING, Status.IN_PROGRESS):
            cancel_at = await self.store.cancel_requested(record.id)
            if cancel_at is not None:
                record = record.moved(Status.CANCELLING, cancel_at)
        counts = record.final_counts
        if counts is None:
            counts = with_counts(record, await self.store.counts(record.id))
        return record.to_openai(counts)

    async def upload(self, request: Request, tenant: Tenant) -> dict[str, Any]:
        limit = self.config.max_file_bytes
        try:
            boundary = boundary_of(request.headers.get("content-type", ""))
            body = await _read_upload(request, limit)
            # Off the event loop: an upload is up to --batch-max-file-bytes.
            parts = await asyncio.to_thread(parse_multipart, body, boundary)
        except MultipartError as exc:
            raise invalid_request(str(exc)) from None
        purpose = parts.get("purpose")
        if purpose is None or purpose.content.decode("utf-8", "replace") != FILE_PURPOSE:
            raise invalid_request(f"purpose must be '{FILE_PURPOSE}': this gateway keeps "
                                  "files for the Batch API only.", param="purpose")  # fmt: skip
        file = parts.get("file")
        if file is None:
            raise invalid_request("The upload has no file field.", param="file")
        if len(file.content) > limit:
            raise _file_too_large(limit)
        record = FileRecord(new_id("file"), tenant.name, file.filename or "upload.jsonl",
                            FILE_PURPOSE, len(file.content), int(time.time()))  # fmt: skip
        await self.store.put_file(record, file.content)
        return record.to_openai()

    async def create(self, request: Request, tenant: Tenant) -> dict[str, Any]:
        body = await read_json_body(request, self.gw.settings.config.max_body_bytes)
        if not isinstance(body, dict):
            raise invalid_request("The body must be a JSON object.")
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise invalid_request(f"endpoint must be one of {list(ENDPOINTS)}, got "
                                  f"{endpoint!r}.", param="endpoint")  # fmt: skip
        if window not in COMPLETION_WINDOWS:
            raise invalid_request(f"completion_window must be one of {list(COMPLETION_WINDOWS)}"
                                  f", got {window!r}.", param="completion_window")  # fmt: skip
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):  # fmt: skip
            raise invalid_request(f"metadata must map at most {MAX_METADATA_KEYS} strings to "
                                  "strings.", param="metadata")  # fmt: skip
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise invalid_request("input_file_id is required.", param="input_file_id")
        file = await self.own_file(tenant, input_file_id)
        if file.purpose != FILE_PURPOSE:
            raise invalid_request(f"The file {input_file_id} was not uploaded with purpose "
                                  f"'{FILE_PURPOSE}'.", param="input_file_id")  # fmt: skip
        now_s = int(time.time())
        record = BatchRecord(new_id("batch"), tenant.name, str(endpoint), input_file_id,
                             str(window), now_s,
                             now_s + math.ceil(self.config.completion_window_s),
                             metadata=metadata)  # fmt: skip
        await self.store.put_batch(record)
        return await self.view(record)

    async def cancel(self, tenant: Tenant, batch_id: str) -> dict[str, Any]:
        record = await self.own_batch(tenant, batch_id)
        if record.status not in (Status.VALIDATING, Status.IN_PROGRESS, Status.CANCELLING):
            raise ApiError(409, f"Cannot cancel a batch with status '{record.status}'.",
                           code="invalid_state")  # fmt: skip
        await self.store.request_cancel(batch_id, int(time.time()))
        now = await self.store.get_batch(batch_id)
        if now is not None and now.status.is_terminal:
            # It ended meanwhile, its progress dropped maybe before this cancel was stored:
            # drop the cancel too, or nothing would. Not where an older router ended it:
            # its counts are still its results'.
            if now.final_counts is not None:
                await self.store.drop_progress(batch_id)
            return await self.view(now)
        return await self.view(record)


def _disabled() -> ApiError:
    return ApiError(
        404,
        "The Batch API is off on this gateway: it needs --redis-url or "
        "--batch-dir to keep files and batches.",
        code="batch_api_disabled",
    )


def _store_guarded(handler: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
    """A route whose store fails (Redis down, the directory's disk) answers 503 with a
    Retry-After, as the Responses API does, not a 500 that reads as a bug in kvflow."""

    @functools.wraps(handler)
    async def guarded(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(*args, **kwargs)
        except STORE_ERRORS as exc:
            log.warning("files and batches unavailable: %s", exc)
            raise ApiError(503, "Files and batches are unavailable for now: their store "
                           "failed. Retry shortly.", type="server_error",
                           code="batch_store_unavailable", retry_after_s=1.0) from exc  # fmt: skip

    return guarded


def add_batch_routes(app: FastAPI, gateway: Gateway, api: BatchApi | None) -> None:
    """The routes; ``api`` None: each answers that the Batch API is off."""

    def ready(request: Request) -> tuple[BatchApi, Tenant]:
        tenant = gateway.authenticate(request.headers)
        if api is None:
            raise _disabled()
        return api, tenant

    @app.post("/v1/files")
    @_store_guarded
    async def upload_file(request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        return await a.upload(request, tenant)

    @app.get("/v1/files")
    @_store_guarded
    async def list_files(request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        query = page_query(_query(request), FILES)
        files, has_more = page(await a.store.list_files(tenant.name), query,
                               id_of=lambda f: f.id, created_s_of=lambda f: f.created_at,
                               purpose_of=lambda f: f.purpose)  # fmt: skip
        return list_object([f.to_openai() for f in files], has_more)

    @app.get("/v1/files/{file_id}")
    @_store_guarded
    async def get_file(file_id: str, request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        return (await a.own_file(tenant, file_id)).to_openai()

    @app.get("/v1/files/{file_id}/content")
    @_store_guarded
    async def file_content(file_id: str, request: Request) -> Response:
        a, tenant = ready(request)
        await a.own_file(tenant, file_id)
        content = await a.store.get_content(file_id)
        if content is None:
            raise _not_found("file", file_id)
        return Response(content, media_type="application/jsonl")

    @app.delete("/v1/files/{file_id}")
    @_store_guarded
    async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        await a.own_file(tenant, file_id)
        for batch in await a.store.list_batches(tenant.name):
            # Its lines are read again after a restart: keep it while they may be needed.
            if batch.input_file_id == file_id and not batch.status.is_terminal:
                raise ApiError(409, f"The file is the input of batch {batch.id}, which is "
                               f"{batch.status}; cancel it or let it finish first.",
                               code="file_in_use")  # fmt: skip
        await a.store.delete_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    @app.post("/v1/batches")
    @_store_guarded
    async def create_batch(request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        return await a.create(request, tenant)

    @app.get("/v1/batches")
    @_store_guarded
    async def list_batches(request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        query = page_query(_query(request), BATCHES)
        batches, has_more = page(await a.store.list_batches(tenant.name), query,
                                 id_of=lambda b: b.id,
                                 created_s_of=lambda b: b.created_at)  # fmt: skip
        # Counted per batch on the page only: a store read or two each.
        return list_object([await a.view(b) for b in batches], has_more)

    @app.get("/v1/batches/{batch_id}")
    @_store_guarded
    async def get_batch(batch_id: str, request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        return await a.view(await a.own_batch(tenant, batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    @_store_guarded
    async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
        a, tenant = ready(request)
        return await a.cancel(tenant, batch_id)
