"""Fixtures of the /metrics tests: expositions served over HTTP. (The stock vLLM they read is the
suite's, tests/conftest.py.)"""
from __future__ import annotations

import http.server
import threading

import pytest


class TextServer:
    """A plain HTTP server answering `routes[path]` (status, body); other paths 404. `stop()` closes it."""

    def __init__(self, routes: dict[str, tuple[int, str]], port: int | None = None):
        self.routes = routes
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                status, body = owner.routes.get(self.path.split("?")[0], (404, "not found"))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port or 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def text_server():
    servers = []

    def start(routes, port=None):
        server = TextServer(routes, port)
        servers.append(server)
        return server
    yield start
    for server in servers:
        server.stop()
