"""A pass-through HTTP proxy that drops request fields a server refuses; for cross-checks.

guidellm sends ``stream_options.continuous_usage_stats``, which kvflow's gateway refuses
(400, unsupported parameter). To compare guidellm and `kvflow bench` on the same
endpoint, both go through this proxy: it removes that field from each JSON body, asks the
server to close the connection after its answer, and streams the answer back untouched,
so the two tools pay the same extra hop. Not a product: one request per connection, no
chunked request bodies. Used by docs/bench.md's cross-check.

    python tests/bench/tools/strip_proxy.py --listen-port 9100 --upstream 127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import asyncio
import json

DROPPED = (("stream_options", "continuous_usage_stats"),)


def rewrite_body(body: bytes) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict):
        return body
    for outer, inner in DROPPED:
        section = obj.get(outer)
        if isinstance(section, dict):
            section.pop(inner, None)
    return json.dumps(obj).encode()


def rewrite_head(head: bytes, body_length: int) -> bytes:
    lines = head.decode("latin-1").split("\r\n")
    kept = [lines[0]]
    for line in lines[1:]:
        name = line.partition(":")[0].strip().lower()
        if line and name not in ("content-length", "connection"):
            kept.append(line)
    kept += [f"Content-Length: {body_length}", "Connection: close"]
    return ("\r\n".join(kept) + "\r\n\r\n").encode("latin-1")


async def handle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: tuple[str, int]
) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = rewrite_body(await reader.readexactly(length))
        up_reader, up_writer = await asyncio.open_connection(*upstream)
        up_writer.write(rewrite_head(head[:-4], len(body)) + body)
        await up_writer.drain()
        while chunk := await up_reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        up_writer.close()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, upstream: tuple[str, int]) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, upstream), "127.0.0.1", port)
    print(f"STRIP_PROXY_READY port={port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen-port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="host:port of the server")
    a = p.parse_args()
    host, _, port = a.upstream.rpartition(":")
    asyncio.run(serve(a.listen_port, (host, int(port))))


if __name__ == "__main__":
    main()
