"""telemetry.stream over real HTTP on its own (no engine): sse-starlette's framing, the keep-alive
comment on a quiet stream, resume after Last-Event-ID, the stream ending with the server, and a client
reading the events in the schema the hello names."""
from __future__ import annotations

import json
import threading
import time

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from httpx_sse import connect_sse

from batchtop.telemetry.events import SCHEMA_VERSION, KnobChanged, StepPlanned
from batchtop.telemetry.protocol.runner import bind_socket
from batchtop.telemetry.protocol.stream import EventRing, events_response
from batchtop.tui.sources.remote import RemoteSource

closing = threading.Event()


def serve(ring: EventRing | None = None, raw: str | None = None):
    """A server of `ring`'s events, or of `raw` text as its event stream (another server's bytes)."""
    app = FastAPI()

    @app.get("/v1/events")
    async def events(request: Request):
        if raw is not None:
            return StreamingResponse(iter([raw]), media_type="text/event-stream")
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


# A StepPlanned as a version-1 server wrote it: without the recompute split
V1_STEP = {"kind": "StepPlanned", "step": 1, "t": 5.0, "prefill_tokens": 32, "decode_tokens": 0,
           "num_prefill_rows": 1, "num_decode_rows": 0, "num_padding_rows": 0, "token_budget": 64,
           "num_running": 1, "num_waiting": 0, "kv_blocks_used": 2, "kv_blocks_total": 40}


def stream_of(hello: dict, *events: dict) -> str:
    return (f"event: hello\ndata: {json.dumps(hello)}\n\n"
            + "".join(f"id: {i}\ndata: {json.dumps(e)}\n\n" for i, e in enumerate(events, 1)))


def followed(raw: str) -> RemoteSource:
    """A dashboard's source on a server of `raw`, once it read the stream (or failed on it)."""
    server, thread, url = serve(raw=raw)
    source = RemoteSource(url, backoff_s=(5.0, 5.0)).start()
    deadline = time.monotonic() + 10
    # the server has no /v1/knobs: its 404 is not the stream's answer, which may still be on its way
    while source.num_connects == 0 and (source.last_error or "HTTP 404").startswith("HTTP 404") \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    source.close()
    server.should_exit = True
    thread.join(10)
    return source


def test_an_older_servers_events_are_read_in_the_schema_its_hello_names():
    source = followed(stream_of({"server_id": "old", "schema_version": 1}, V1_STEP))
    (step,) = source.poll().events
    assert isinstance(step, StepPlanned)
    assert (step.prefill_tokens, step.recompute_tokens, step.num_recompute_rows) == (32, 0, 0)


def test_a_newer_servers_stream_is_refused_saying_what_to_do():
    source = followed(stream_of({"server_id": "new", "schema_version": SCHEMA_VERSION + 1}, V1_STEP))
    assert source.poll().events == []
    assert f"schema version {SCHEMA_VERSION + 1}" in source.last_error
    assert "upgrade batchtop" in source.last_error and not source.connected
