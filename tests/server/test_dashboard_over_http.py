"""`batchtop top --url`: the dashboard app driven by a RemoteSource over the test server."""
from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time

import httpx
import pytest
from server_helpers import wait_idle

from batchtop.engine.server.app import ServerThread
from batchtop.engine.server.host import BatchtopServer
from batchtop.tui.sources.remote import RemoteSource


async def answered(pilot, app, timeout_s: float = 10.0) -> None:
    """Wait for the remote's answer to the last command (it comes back as a message)."""
    deadline = time.monotonic() + timeout_s
    while "waiting for its answer" in app.dashboard.status_message and time.monotonic() < deadline:
        await pilot.pause(0.05)


def test_dashboard_follows_server_and_pauses_it(served):
    from batchtop.tui.app import BatchtopApp
    # its own front: its pause is its own
    server = BatchtopServer(served[0].loop, served[0].subscription._bus)
    front = ServerThread(server).start()
    httpx.post(front.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 5},
               timeout=30)

    async def drive():
        app = BatchtopApp(source_factory=lambda: RemoteSource(front.url), loading_what=front.url, tick_s=None)
        async with app.run_test() as pilot:
            for _ in range(100):
                await pilot.pause(0.05)
                app.tick()
                if isinstance(app.source, RemoteSource) and app.source.connected and app.model.last_t:
                    break
            assert isinstance(app.source, RemoteSource) and app.source.connected
            assert app.model.last_t                       # events reached the view model
            await pilot.press("space")
            await answered(pilot, app)
            assert app.source.paused and server.paused
            await pilot.press("space")
            await answered(pilot, app)
            assert not app.source.paused and not server.paused
            app.source.close()

    try:
        asyncio.run(drive())
    finally:
        front.stop()
        wait_idle(served[0])


class SlowControl(http.server.BaseHTTPRequestHandler):
    """A server that answers its knob table at once and holds every command until the test releases it."""
    posts: list[str] = []
    release = threading.Event()

    def do_GET(self):
        if self.path.startswith("/v1/knobs"):
            self._reply(200, {"knobs": {"max_num_seqs": 8}, "paused": False})
        else:
            self._reply(404, {"error": {"message": "no events here"}})

    def do_POST(self):
        SlowControl.posts.append(self.path)
        SlowControl.release.wait(30)
        self._reply(200, {"paused": True})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def slow_server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowControl)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    SlowControl.release.set()                       # a failed test leaves no handler waiting
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.asyncio
async def test_a_slow_server_never_holds_the_screen(slow_server):
    """A command goes from a worker thread: the next key is served while the server holds the command
    unanswered, and the answer is shown when it comes."""
    from batchtop.tui.app import BatchtopApp
    from batchtop.tui.dashboard import VIEWS
    source = RemoteSource(slow_server, backoff_s=(5.0, 5.0))
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test() as pilot:
        SlowControl.posts.clear()
        SlowControl.release.clear()
        await pilot.press("space")
        await pilot.press("2")                      # served while the server holds the pause
        assert app.dashboard.view == VIEWS[1] and "waiting for its answer" in app.dashboard.status_message
        assert not source.paused
        await pilot.press("space")                  # before the answer: refused, not sent again
        assert "not answered the last command yet" in app.dashboard.status_message
        deadline = time.monotonic() + 10
        while not SlowControl.posts and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert SlowControl.posts == ["/v1/pause"] and not source.paused
        SlowControl.release.set()
        deadline = time.monotonic() + 10
        while app.dashboard.status_message != "the remote source answered" and time.monotonic() < deadline:
            await pilot.pause(0.05)
        assert source.paused and app.dashboard.status_message == "the remote source answered"
        assert SlowControl.posts == ["/v1/pause"]
    source.close()
