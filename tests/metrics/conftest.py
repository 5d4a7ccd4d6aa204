"""Fixtures of the /metrics tests: expositions served over HTTP, and one stock vLLM per session.

The stock vLLM (no batchtop scheduler class) starts eager (~25 s here), one OpenMP thread, with a
small KV pool (6 blocks of 128 tokens, max_model_len 512, 8 rows) so a short load makes requests wait.
Its whole process group is stopped at the end of the session.
"""
from __future__ import annotations

import http.server
import threading

import pytest
from metrics_helpers import skip_without_vllm, stock_vllm_options

STOCK_VLLM_PORT = 8210


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


@pytest.fixture(scope="session")
def stock_vllm():
    """A running stock vLLM: (LaunchedServer, url)."""
    skip_without_vllm()
    from batchtop.engine.vllm.launch import launch_vllm
    server = launch_vllm(stock_vllm_options(STOCK_VLLM_PORT))
    try:
        server.wait_healthy(timeout=300)
        yield server, server.url
    finally:
        server.stop()
        assert not server.group_alive(), "vLLM processes left behind"
