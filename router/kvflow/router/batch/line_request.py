"""A Batch API line as a request that came in through the gateway's own app (batch/runner.py
sends it down the completion path): the app's state, the batch priority class, the scope
key that prices it at the batch factor, and a client that never leaves until the router
stops."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request

from kvflow.proto.priority_class import HEADER as PRIORITY_CLASS_HEADER
from kvflow.proto.priority_class import PriorityClass
from kvflow.router.batch.scope import BATCH_SCOPE_KEY


def line_request(
    app: FastAPI, endpoint: str, body: dict[str, Any], request_id: str, stopping: asyncio.Event
) -> Request:
    """The line as a request that came in through this app: the app's own state, the
    batch class header, and a client that never leaves until the router stops."""
    payload = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await stopping.wait()
        return {"type": "http.disconnect"}

    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (PRIORITY_CLASS_HEADER.encode(), PriorityClass.BATCH.value.encode()),
    ]
    scope = {"type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": endpoint, "raw_path": endpoint.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "client": None, "server": None,
             "app": app, "state": {"request_id": request_id},
             BATCH_SCOPE_KEY: True}  # fmt: skip
    return Request(scope, receive)
