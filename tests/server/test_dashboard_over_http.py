"""`batchtop top --url`: the dashboard app driven by a RemoteSource over the test server."""
from __future__ import annotations

import asyncio

import httpx
from server_helpers import wait_idle

from batchtop.engine.server.app import ServerThread
from batchtop.engine.server.host import BatchtopServer
from batchtop.tui.remote_source import RemoteSource


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
            assert app.source.paused and server.paused
            await pilot.press("space")
            assert not app.source.paused and not server.paused
            app.source.close()

    try:
        asyncio.run(drive())
    finally:
        front.stop()
        wait_idle(served[0])
