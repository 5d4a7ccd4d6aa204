"""telemetry.stream over real HTTP on its own (no engine): sse-starlette's framing, the keep-alive
comment on a quiet stream, resume after Last-Event-ID, and the stream ending with the server."""
from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from httpx_sse import connect_sse

from batchtop.telemetry.events import KnobChanged
from batchtop.telemetry.protocol.runner import bind_socket
from batchtop.telemetry.protocol.stream import EventRing, events_response

closing = threading.Event()


def serve(ring: EventRing):
    app = FastAPI()

    @app.get("/v1/events")
    async def events(request: Request):
        return events_response(ring, request.headers.get("last-event-id"), None, {"server_id": "s1"},
                               closing=closing.is_set, heartbeat_s=0.2)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_resume_keep_alive_and_shutdown():
    ring = EventRing(100)
    ring.extend([KnobChanged(step=step, t=float(step), name="max_num_seqs", old=step, new=step + 1,
                             source="test") for step in range(5)])
    server, thread, url = serve(ring)
    try:
        with httpx.Client(timeout=10) as client:
            with client.stream("GET", url + "/v1/events", headers={"Last-Event-ID": "2"}) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    if line == ": keep-alive":
                        break
            assert lines[0] == "event: hello" and json.loads(lines[1][len("data: "):])["start_seq"] == 3
            assert [line for line in lines if line.startswith("id: ")] == ["id: 3", "id: 4", "id: 5"]
            with connect_sse(client, "GET", url + "/v1/events", headers={"Last-Event-ID": "4"}) as source:
                messages = []
                for message in source.iter_sse():
                    messages.append(message)
                    if message.id == "5":
                        break
            assert [m.event for m in messages] == ["hello", "message"]
            assert json.loads(messages[1].data)["new"] == 5
    finally:
        closing.set()
        server.should_exit = True
        thread.join(10)
    assert not thread.is_alive()
