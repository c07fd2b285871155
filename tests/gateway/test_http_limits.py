"""The HTTP listener's own limits against a real router process and raw sockets: a huge
header refused without the router's memory growing, headers that never finish, too many
connections, a client that stops reading its stream (cut, its concurrency slot freed),
keep-alive comments on a quiet stream, and TLS on the gateway's listener."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.scrape import sample

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENS = load_text_model(None).tokenizer.encode(" fox", add_special_tokens=False)
KEY = "sk-http-limits-0123456789"


@contextmanager
def gateway_with(worker: FakeWorker, *args: str, tmp_path: Path | None = None,
                 max_concurrent: int | None = None) -> Iterator[GatewayProcess]:  # fmt: skip
    extra: list[str] = []
    if tmp_path is not None:  # one tenant, KEY
        tenant: dict[str, object] = {"name": "t", "api_key_sha256": hash_api_key(KEY)}
        if max_concurrent is not None:
            tenant["max_concurrent_requests"] = max_concurrent
        config = tmp_path / "router.yaml"
        config.write_text(yaml.safe_dump({"tenants": [tenant]}))
        extra = ["--config", str(config)]
    with running_fake_worker(worker) as address:
        g = launch_gateway(["--workers", address, *extra, *args])
        try:
            g.wait_ready(num_workers=1)
            yield g
        finally:
            g.stop()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def read_response(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything until the server closes (or the timeout)."""
    sock.settimeout(timeout_s)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (TimeoutError, ConnectionResetError):
        pass
    return b"".join(chunks)


def refusals(g: GatewayProcess, reason: str) -> float:
    return sample(f"{g.url}/metrics", "kvflow_router_http_refusals_total", reason=reason)


def test_a_10_mib_header_is_refused_with_431_and_the_memory_stays_flat() -> None:
    with gateway_with(FakeWorker(tokens=TOKENS), "--max-header-bytes", "65536") as g:
        pid = g.proc.pid
        httpx.get(f"{g.url}/health")
        before = rss_bytes(pid)
        with socket.create_connection(("127.0.0.1", g.port)) as sock:
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
            body = b"a" * (10 * 1024 * 1024)

            def send() -> None:
                # Cut after the lingering close: what matters is the answer.
                with contextlib.suppress(OSError):
                    sock.sendall(head + body + b"\r\n\r\n")

            sender = threading.Thread(target=send)
            sender.start()
            answer = read_response(sock)
            sender.join(timeout=30)
        grown = rss_bytes(pid) - before
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "header_too_large" and "65536" in error["message"]
        # The 10 MiB went by without being kept: the router grew by far less than it.
        assert grown < 2 * 1024 * 1024, grown
        assert refusals(g, "header_too_large") == 1
        # Headers just under the limit still pass.
        r = httpx.get(f"{g.url}/health", headers={"x-fill": "b" * 60_000})
        assert r.status_code == 200


def test_headers_that_never_finish_get_408_after_the_header_timeout() -> None:
    with gateway_with(FakeWorker(tokens=TOKENS), "--header-timeout-s", "1") as g:
        with socket.create_connection(("127.0.0.1", g.port)) as sock:
            started = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            answer = read_response(sock)
            elapsed_s = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert 0.9 <= elapsed_s < 5, elapsed_s
        # A connection that sends nothing at all is closed the same way.
        with socket.create_connection(("127.0.0.1", g.port)) as sock:
            assert read_response(sock).startswith(b"HTTP/1.1 408 ")
        assert refusals(g, "header_timeout") == 2


def test_a_body_dribbled_after_its_headers_gets_408_after_the_body_timeout() -> None:
    with gateway_with(FakeWorker(tokens=TOKENS), "--body-timeout-s", "1") as g:
        body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 1}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
                f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        with socket.create_connection(("127.0.0.1", g.port)) as sock:
            started = time.monotonic()
            sock.sendall(head)
            # One byte every 0.2 s: the connection never idles as long as the header timeout,
            # but the whole body would take far longer than the body timeout.
            for byte in body[:20]:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # the gateway has answered and closed
                    break
                time.sleep(0.2)
            answer = read_response(sock)
            elapsed_s = time.monotonic() - started
        status, _, rest = answer.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408 "), answer[:300]
        head_text, _, payload = rest.partition(b"\r\n\r\n")
        assert b"connection: close" in head_text.lower()
        error = json.loads(payload)["error"]
        assert error["code"] == "body_timeout" and "--body-timeout-s" in error["message"]
        assert 0.9 <= elapsed_s < 5, elapsed_s
        assert refusals(g, "body_timeout") == 1
        # A body sent at once is unaffected, and the gateway serves on.
        r = httpx.post(f"{g.base_url}/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        assert refusals(g, "body_timeout") == 1


def test_past_max_connections_a_request_gets_503_with_retry_after() -> None:
    with gateway_with(FakeWorker(tokens=TOKENS), "--max-connections", "3") as g:
        idle = [socket.create_connection(("127.0.0.1", g.port)) for _ in range(3)]
        try:
            time.sleep(0.2)  # the router has accepted them
            with socket.create_connection(("127.0.0.1", g.port)) as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = read_response(sock)
            head, body = answer.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 503 "), head
            assert b"retry-after: 1" in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert httpx.get(f"{g.url}/health").status_code == 200
        assert refusals(g, "too_many_connections") == 1


def test_a_client_that_stops_reading_its_stream_is_cut_and_frees_its_slot(
    tmp_path: Path,
) -> None:
    # Enough output (8 choices of 8000 chunks: about 12 MB) to fill the transport's buffer,
    # the router's socket buffer and the client's tiny one: the router's writes then block.
    worker = FakeWorker(tokens=TOKENS * 8000, max_model_len=1_000_000)
    with gateway_with(worker, "--write-timeout-s", "1", tmp_path=tmp_path,
                      max_concurrent=1) as g:  # fmt: skip
        body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 8000, "n": 8,
                           "stream": True}).encode()  # fmt: skip
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", g.port))
        try:
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    b"Authorization: Bearer " + KEY.encode() + b"\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")  # fmt: skip
            sock.sendall(head + body)
            # ... and reads nothing. Meanwhile the tenant's one slot is held.
            deadline = time.monotonic() + 60
            while refusals(g, "write_timeout") < 1:
                assert time.monotonic() < deadline, "the stalled client was never cut"
                time.sleep(0.25)
            # The slot is free: the same tenant's next request gets in.
            r = httpx.post(f"{g.base_url}/completions", headers={"authorization": f"Bearer {KEY}"},
                           json={"model": "fake", "prompt": "hi", "max_tokens": 2},
                           timeout=60)  # fmt: skip
            assert r.status_code == 200, r.text
        finally:
            sock.close()
        assert "Exception in ASGI application" not in "".join(g.log)


def test_a_quiet_stream_carries_keep_alive_comments() -> None:
    worker = FakeWorker(tokens=TOKENS * 2, token_delay_s=1.2)
    with gateway_with(worker, "--sse-keepalive-interval-s", "0.3") as g:
        body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{g.base_url}/completions", json=body, timeout=30) as r:
            lines = list(r.iter_lines())
        assert r.status_code == 200
        data = [line for line in lines if line.startswith("data: ")]
        keepalives = [i for i, line in enumerate(lines) if line == ": keep-alive"]
        assert data[-1] == "data: [DONE]" and len(data) >= 3
        # Between the first token and the second (1.2 s apart), several comments.
        assert len(keepalives) >= 2, lines
        assert lines.index(data[0]) < keepalives[-1] < lines.index(data[-1])


def test_the_gateway_serves_https_with_a_given_certificate(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    with running_fake_worker(FakeWorker(tokens=TOKENS)) as address:
        g = launch_gateway(["--workers", address, "--tls-cert-file", str(cert),
                            "--tls-key-file", str(key)])  # fmt: skip
        try:
            url = f"https://127.0.0.1:{g.port}"
            trust = ssl.create_default_context(cafile=str(cert))
            assert httpx.get(f"{url}/health", verify=trust).json() == {"status": "ok"}
            with pytest.raises(httpx.HTTPError):  # plain HTTP is not served there
                httpx.get(f"http://127.0.0.1:{g.port}/health", timeout=5)
        finally:
            g.stop()
