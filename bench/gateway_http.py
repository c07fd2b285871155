"""A minimal HTTP/1.1 keep-alive client for the gateway benchmark.

httpx spends about 1 ms of CPU per request in Python; on a 2-core machine that shares the
cores with the gateway, the load generator would measure itself. This one writes the
request bytes, reads the status line, the headers and a Content-Length body: enough for
the gateway's JSON answers, and about 10x cheaper.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Mapping


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer


class HttpClient:
    def __init__(self, host: str, port: int) -> None:
        self._host = host
        self._port = port
        self._idle: list[_Connection] = []

    async def _connect(self, *, fresh: bool) -> _Connection:
        if self._idle and not fresh:
            return self._idle.pop()
        reader, writer = await asyncio.open_connection(self._host, self._port)
        return _Connection(reader, writer)

    async def post(
        self, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """(status, body) of one POST with a JSON body and any extra headers."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        try:
            return await self._post(path, body, extra, fresh=False)
        except (ConnectionError, asyncio.IncompleteReadError):
            # The server closes keep-alive connections idle for 5 s: retry once, anew.
            return await self._post(path, body, extra, fresh=True)

    async def _post(self, path: str, body: bytes, extra: str, *, fresh: bool) -> tuple[int, bytes]:
        conn = await self._connect(fresh=fresh)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self._host}:{self._port}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        conn.writer.write(head + body)
        status_line = await conn.reader.readline()
        if not status_line:
            conn.writer.close()
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        length = 0
        keep_alive = True
        while True:
            line = await conn.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                keep_alive = False
        payload = await conn.reader.readexactly(length)
        if keep_alive:
            self._idle.append(conn)
        else:
            conn.writer.close()
        return status, payload

    async def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()


def wait_ready(url: str, num_workers: int, *, timeout_s: float, poll_s: float) -> None:
    """Poll the gateway's ``/ready`` every ``poll_s`` until it sees ``num_workers`` healthy
    workers; RuntimeError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
                if json.load(r)["workers_healthy"] >= num_workers:
                    return
        except OSError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"the gateway did not see {num_workers} healthy workers")
