"""`create_app(gateway, drain)`: thin routes over the gateway; every error leaves in OpenAI's
shape; a draining router's /ready says 503 and new requests get one (api/drain.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvflow.router import tracing
from kvflow.router.api.completions import handle_completion
from kvflow.router.api.drain import DrainMiddleware, DrainState
from kvflow.router.api.embeddings import handle_embeddings
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.http import (
    RequestIdMiddleware,
    SseKeepAliveMiddleware,
    TracingMiddleware,
)
from kvflow.router.api.openapi import build_openapi
from kvflow.router.api.response_cache import purge as purge_answers
from kvflow.router.api.response_store import ResponseStore
from kvflow.router.api.responses import handle_response, stored_input_items, stored_response
from kvflow.router.batch.routes import ENDPOINT_PATHS
from kvflow.router.batch.service import install_batches
from kvflow.router.protocol.errors import ApiError

log = logging.getLogger("kvflow.router.api")

_ENDPOINTS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/models",
        "/v1/usage",
        "/v1/response_cache/purge",
        "/health",
        "/ready",
        "/metrics",
        "/openapi.json",
        *ENDPOINT_PATHS,
    }
)


def _error(status: int, message: str, *, type_: str, code: str | None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def _model_card(name: str, created_s: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created_s, "owned_by": "kvflow"}


def create_app(gateway: Gateway, drain: DrainState | None = None) -> FastAPI:
    started_s = int(time.time())
    drain = drain if drain is not None else DrainState()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        if batches is not None:
            batches.start()
        try:
            yield
        finally:
            if batches is not None:
                await batches.stop()
            await gateway.stop()

    # /openapi.json is served below, per caller: FastAPI's own route would list every model.
    app = FastAPI(
        title="kvflow gateway", docs_url=None, redoc_url=None, openapi_url=None,
        lifespan=lifespan,
    )  # fmt: skip
    vocab_size = max(b.text.tokenizer.vocab_size for b in gateway.backends)
    app.state.gateway = gateway
    # Stored Responses (api/response_store.py): shared through Redis when the gateway has it.
    kept = gateway.settings.responses
    app.state.responses = ResponseStore(gateway.redis, gateway.settings.quota_scope,
                                        kept.ttl_s, kept.max_memory_bytes)  # fmt: skip
    app.state.drain = drain
    if gateway.settings.sse_keepalive_interval_s > 0:  # innermost: sees the stream's bytes
        app.add_middleware(SseKeepAliveMiddleware,
                           interval_s=gateway.settings.sse_keepalive_interval_s)  # fmt: skip
    # Added first, so it runs inside RequestIdMiddleware: its 503s get an id and a count.
    app.add_middleware(DrainMiddleware, state=drain)
    if tracing.is_enabled():  # between the two: its span knows the request id
        app.add_middleware(TracingMiddleware)
    app.add_middleware(RequestIdMiddleware, metrics=gateway.metrics, endpoints=_ENDPOINTS)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(404, f"Unknown endpoint {request.method} {request.url.path}; "
                          "the API lives under /v1 (see /v1/models).",
                          type_="invalid_request_error", code="unknown_url")  # fmt: skip
        return _error(exc.status_code, str(exc.detail), type_="invalid_request_error", code=None)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", "?")
        log.error("request %s failed", request_id, exc_info=exc)
        return _error(
            500,
            f"The gateway failed on this request (request id {request_id}); this is a bug "
            "in kvflow, please report it with the request id.",
            type_="server_error",
            code="internal_error",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle_completion(request, is_chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_completion(request, is_chat=False)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle_response(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return await stored_response(request, response_id, delete=False)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> dict[str, Any]:
        return await stored_input_items(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await stored_response(request, response_id, delete=True)

    batches = install_batches(app, gateway)  # /v1/files, /v1/batches (batch/)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await handle_embeddings(request)

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict[str, Any]:
        tenant = gateway.authenticate(request.headers)
        names = [m for m in gateway.served_models() if tenant.may_use(m)]
        return {"object": "list", "data": [_model_card(m, started_s) for m in names]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> dict[str, Any]:
        tenant = gateway.authenticate(request.headers)
        gateway.check_model(model, tenant)
        return _model_card(model, started_s)

    @app.get("/v1/usage")
    async def usage(request: Request) -> dict[str, Any]:
        """The caller's tenant's totals: across replicas when Redis is up, else this one's."""
        tenant = gateway.authenticate(request.headers)
        totals, scope = await gateway.quotas.read_usage(tenant)
        return {"object": "usage", "tenant": tenant.name, "scope": scope, **totals.as_dict()}

    @app.post("/v1/response_cache/purge")
    async def purge_response_cache(request: Request) -> dict[str, Any]:
        """Admins: drop stored answers (api/response_cache.py)."""
        return await purge_answers(request, gateway)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        caller = gateway.caller_or_none(request.headers)
        is_ready, body = gateway.readiness(drain.is_draining, caller)
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        """The schema anyone may read; its model enum lists only the caller's models (none
        for a caller without a valid key when tenants are configured)."""
        caller = gateway.caller_or_none(request.headers)
        names = [m for m in gateway.served_models() if caller is not None and caller.may_use(m)]
        limits = gateway.settings.request_limits
        document = build_openapi(served_models=names, vocab_size=vocab_size, limits=limits)
        return JSONResponse(document)

    if gateway.settings.metrics_port is None:  # else on its own port (cli.py)

        @app.get("/metrics")
        async def metrics() -> Response:
            registry = gateway.metrics.registry
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
