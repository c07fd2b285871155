"""GET /healthz for the operator's liveness probe, served from the first second on, and
GET /metrics (the planner's inputs and decisions; empty on a replica that does not lead).

kopf has its own liveness endpoint, but it starts with kopf, and a standby replica waiting
for the Lease never starts kopf: its probe would fail and the kubelet would restart it in a
loop. This endpoint answers 200 whenever the event loop is responsive, leader or not.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


async def serve_health(
    port: int, state: Callable[[], str], registry: CollectorRegistry | None = None
) -> web.AppRunner:
    """Start serving; `state()` is the body ("leading", "waiting for lease"). Call
    `await runner.cleanup()` to stop."""

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text=state() + "\n")

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(registry) if registry is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner
