"""The worker's HTTP side: ``/metrics`` for Prometheus, ``/health`` and ``/ready`` for probes.

A stdlib server on its own thread: a kubelet probe must answer even while the event loop
is busy, and this needs no web framework in the worker image.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def start_http_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    is_ready: Callable[[], bool],
    health_problem: Callable[[], str | None] = lambda: None,
) -> ThreadingHTTPServer:
    """``/health`` fails with ``health_problem()``'s text (the engine thread stopped or
    stuck: liveness.py) so the kubelet restarts the worker; ``/ready`` fails while
    ``is_ready()`` is false (draining) or the worker is not healthy."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif self.path == "/health":
                problem = health_problem()
                if problem is None:
                    self._send(200, b"ok\n")
                else:
                    self._send(503, f"unhealthy: {problem}\n".encode())
            elif self.path == "/ready":
                ok = is_ready() and health_problem() is None
                self._send(200 if ok else 503, b"ready\n" if ok else b"not ready\n")
            else:
                self._send(404, b"not found: try /metrics, /health or /ready\n")

        def _send(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds would drown the log

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    return server
