"""Send one streaming request with httpx and record what happened, whatever happens.

Never raises for the server's or the network's failures: each becomes a record with an
error kind, so a run's errors are counted by kind instead of ending the run. The
connection pool is unbounded on purpose: a pool limit would queue requests inside the
client, and the queueing would be charged to nobody (coordinated omission by the back
door).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from kvflow.loadgen.payloads import (
    ROUTE_HEADER,
    EndpointConfig,
    error_message,
    parse_route_header,
)
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.sse import StreamAccumulator

Clock = Callable[[], float]


class BenchClient:
    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self._headers = config.headers()
        self._http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            # Per read; the whole request is bounded by request_timeout_s below.
            timeout=httpx.Timeout(config.request_timeout_s, connect=30.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(
        self, request_id: str, body: bytes, *, scheduled_s: float | None, now: Clock
    ) -> RequestRecord:
        stream = StreamAccumulator(request_id, scheduled_s, now())
        worker: str | None = None
        predicted: int | None = None
        outcome: str | None = None
        error: str | None = None
        detail = ""
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                async with self._http.stream(
                    "POST", self.config.url, content=body, headers=self._headers
                ) as response:
                    route = parse_route_header(response.headers.get(ROUTE_HEADER))
                    if route is not None:
                        worker, predicted = route.worker, route.prefix_blocks
                        if route.prefix_outcome is not None:
                            outcome = route.prefix_outcome.value
                    if response.status_code != httpx.codes.OK:
                        error = f"http_{response.status_code}"
                        detail = error_message(response.status_code, await response.aread())
                    else:
                        async for line in response.aiter_lines():
                            stream.on_line(line, now())
        except TimeoutError:
            error, detail = "timeout", f"no answer within {self.config.request_timeout_s:g} s"
        except httpx.TimeoutException as exc:
            error, detail = "timeout", f"{type(exc).__name__}: {exc}"
        except httpx.ConnectError as exc:
            error, detail = "connect_error", str(exc) or type(exc).__name__
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            error, detail = "connection_lost", str(exc) or type(exc).__name__
        except httpx.HTTPError as exc:
            error, detail = "http_error", f"{type(exc).__name__}: {exc}"
        return stream.finish(
            now(),
            error=error,
            error_detail=detail,
            worker=worker,
            predicted_cached_blocks=predicted,
            prefix_outcome=outcome,
        )
