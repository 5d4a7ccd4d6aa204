"""The SSE event stream (resume without gaps, the history limit said out loud), control endpoints,
the remote dashboard source, and /metrics."""
from __future__ import annotations

import json
import time

import httpx
from server_helpers import wait_idle

from batchtop.engine.server.app import ServerThread
from batchtop.engine.server.host import BatchtopServer
from batchtop.telemetry.events import SCHEMA_VERSION, EngineSnapshot, EventsDropped, KnobChanged, StepFinished
from batchtop.telemetry.protocol import stream
from batchtop.tui.sources.remote import RemoteSource


def read_sse(url: str, *, headers=None, params=None, until=None, timeout: float = 20.0) -> list[dict]:
    """Messages as {"event", "id", "data"} until `until(messages)` is true."""
    messages, current = [], {"event": None, "id": None, "data": []}
    deadline = time.monotonic() + timeout
    with httpx.stream("GET", url + "/v1/events", headers=headers or {}, params=params or {},
                      timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith(":"):
                continue
            if line:
                field, _, value = line.partition(": ")
                if field == "data":
                    current["data"].append(value)
                else:
                    current[field] = value
                continue
            messages.append({**current, "data": json.loads("\n".join(current["data"]))})
            current = {"event": None, "id": None, "data": []}
            if until(messages) or time.monotonic() > deadline:
                break
    return messages


def generate(base_url: str, n: int = 2, max_tokens: int = 6) -> None:
    for _ in range(n):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": max_tokens}
        r = httpx.post(base_url + "/v1/completions", json=body)
        assert r.status_code == 200


def telemetry(messages):
    return [m for m in messages if m["event"] is None]


def test_resume_with_last_event_id_has_no_gap(served, base_url):
    server, _ = served
    wait_idle(server)
    server.pump()
    start = server.ring.next_seq
    generate(base_url)
    server.pump()
    end = server.ring.next_seq
    assert end - start > 10
    first = read_sse(base_url, params={"from_step": 0},
                     until=lambda ms: any(m["id"] == str(start + 4) for m in ms))
    assert first[0]["event"] == "hello"
    assert first[0]["data"]["schema_version"] == SCHEMA_VERSION      # the schema its events are in
    last_id = telemetry(first)[-1]["id"]
    second = read_sse(base_url, headers={"Last-Event-ID": last_id},
                      until=lambda ms: any(m["id"] == str(end - 1) for m in ms))
    assert second[0]["event"] == "hello" and second[0]["data"]["start_seq"] == int(last_id) + 1
    ids = [int(m["id"]) for m in telemetry(first) + telemetry(second)]
    assert ids == list(range(ids[0], end))                       # contiguous: no gap, no duplicate
    assert not [m for m in second if m["event"] == "gap"]


def test_from_step_starts_at_that_step(served, base_url):
    server, _ = served
    generate(base_url, n=1)
    server.pump()
    step = server.ring.event(server.ring.next_seq - 1).step - 2
    messages = telemetry(read_sse(base_url, params={"from_step": step}, until=lambda ms: len(ms) > 3))
    assert messages[0]["data"]["step"] == step
    expected = server.ring.seq_of_step(step)
    assert int(messages[0]["id"]) == expected and server.ring.event(expected - 1).step < step


def test_older_than_history_is_said_in_the_stream(served, base_url):
    server, _ = served
    small = BatchtopServer(server.loop, server.subscription._bus, event_history=20)
    with ServerThread(small) as front:
        generate(base_url, n=2)
        small.pump()
        assert small.ring.oldest_seq > 1
        messages = read_sse(front.url, headers={"Last-Event-ID": "1"}, until=lambda ms: len(ms) >= 4)
        gap = messages[1]
        assert gap["event"] == "gap"
        # the ring's oldest as the gap was sent: the engine's events since may have pushed it further
        assert gap["data"]["requested_seq"] == 2 and 2 < gap["data"]["oldest_seq"] <= small.ring.oldest_seq
        assert gap["data"]["lost"] == gap["data"]["oldest_seq"] - 2 and "older than" in gap["data"]["message"]
        assert int(messages[2]["id"]) == gap["data"]["oldest_seq"]
        by_step = read_sse(front.url, params={"from_step": 0}, until=lambda ms: len(ms) >= 3)
        assert by_step[1]["event"] == "gap" and by_step[1]["data"]["requested_step"] == 0


def test_bad_resume_requests(base_url):
    assert httpx.get(base_url + "/v1/events", headers={"Last-Event-ID": "abc"}).status_code == 400
    assert httpx.get(base_url + "/v1/events", params={"from_step": -1}).status_code == 400


def test_knobs_pause_step_resume_abort(served, base_url):
    server, _ = served
    http = httpx.Client(base_url=base_url, timeout=10)
    wait_idle(server)
    knobs = http.get("/v1/knobs").json()
    assert knobs["knobs"]["max_num_seqs"] == 32 and knobs["block_size"] == 16
    ok = http.post("/v1/knobs", json={"name": "max_num_seqs", "value": "16"})
    assert ok.status_code == 200 and ok.json()["value"] == 16
    deadline = time.monotonic() + 5
    while http.get("/v1/knobs").json()["knobs"]["max_num_seqs"] != 16 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.engine.knobs()["max_num_seqs"] == 16
    http.post("/v1/knobs", json={"name": "max_num_seqs", "value": 32})

    assert http.post("/v1/pause").json() == {"paused": True}
    import threading
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        r=httpx.post(base_url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 100},
                     timeout=30)))
    worker.start()
    deadline = time.monotonic() + 5
    while not server.engine.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    (rid,) = [r for r, req in server.engine.requests.items() if not req.finished]
    steps = server.engine.step_count
    time.sleep(0.2)
    assert server.engine.step_count == steps                     # paused: nothing runs
    assert http.post("/v1/step").status_code == 200
    deadline = time.monotonic() + 5
    while server.engine.step_count == steps and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert server.engine.step_count == steps + 1                 # exactly one step
    assert http.post(f"/v1/requests/{rid}/abort").json() == {"id": rid, "aborted": True}
    worker.join(10)
    assert result["r"].json()["choices"][0]["finish_reason"] == "abort"
    assert http.post("/v1/resume").json() == {"paused": False}
    wait_idle(server)


def test_metrics_names(served, base_url):
    generate(base_url, n=1)
    text = httpx.get(base_url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "batchtop_kv_blocks_total",
                 "batchtop_requests_running", "batchtop_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert f"\n{name}{{" in text, name
    assert '# TYPE vllm:time_to_first_token_seconds histogram' in text
    assert 'le="+Inf"' in text


def test_remote_source_follows_controls_and_resumes(served):
    server = BatchtopServer(served[0].loop, served[0].subscription._bus)   # a front of its own to restart
    front = ServerThread(server).start()
    port = front.sock.getsockname()[1]
    source = RemoteSource(front.url, backoff_s=(0.1, 0.5)).start()
    try:
        assert source.knobs["block_size"] == 16 and source.meta["model"] == "tiny"
        _wait(lambda: source.connected)
        generate(front.url, n=1)
        events = _poll_until(source, lambda evs: any(isinstance(e, StepFinished) for e in evs))
        assert "max_num_seqs must be an integer in [1," in source.set_knob("max_num_seqs", 0)
        assert source.set_knob("long_prefill_token_threshold", 8) is None
        events += _poll_until(source, lambda evs: any(isinstance(e, KnobChanged) for e in evs))
        assert source.step_once() == "the engine is running: pause it first, then step"
        assert source.toggle_pause() is None and source.paused
        assert source.toggle_pause() is None and not source.paused
        assert "no unfinished request" in source.abort("nope")
        assert source.request_snapshot() is None           # what a recording that begins now starts from
        events += _poll_until(source, lambda evs: any(isinstance(e, EngineSnapshot) and e.cause == "request"
                                                      for e in evs))
        source.set_knob("long_prefill_token_threshold", 0)
        seq_before = source.last_seq

        front.stop()                                              # the server goes away ...
        _wait(lambda: not source.connected)
        assert source.status().startswith("disconnected from")
        generate(served[1].url, n=1)                              # ... while the engine keeps working
        front = ServerThread(server, port=port).start()            # ... and comes back on the same port
        _wait(lambda: source.connected and source.num_connects >= 2)
        server.pump()
        end = server.ring.next_seq
        more = _poll_until(source, lambda evs: source.last_seq == end - 1)
        assert source.last_seq == end - 1 and not any(isinstance(e, EventsDropped) for e in more)
        assert seq_before < end - 1
    finally:
        source.close()
        front.stop()


def test_remote_source_stays_connected_through_keep_alives(served, monkeypatch):
    """httpx-sse hands a keep-alive after an event on as a message without data (and the last id); the
    dashboard's source skips it instead of failing on it and reconnecting."""
    monkeypatch.setattr(stream, "HEARTBEAT_S", 0.1)
    server = BatchtopServer(served[0].loop, served[0].subscription._bus)
    front = ServerThread(server).start()
    source = RemoteSource(front.url, backoff_s=(0.1, 0.5)).start()
    try:
        _wait(lambda: source.connected)
        generate(front.url, n=1)
        _poll_until(source, lambda evs: any(isinstance(e, StepFinished) for e in evs))
        time.sleep(1.0)                                           # ~10 keep-alives after the events
        assert source.connected and source.num_connects == 1, source.last_error
    finally:
        source.close()
        front.stop()


def test_closing_the_remote_source_of_a_quiet_server_ends_its_reader_at_once(served):
    """The reader thread waits in a read of the stream, and a quiet server sends nothing but a keep-alive
    every HEARTBEAT_S (10 s): closing the source must end that read, not wait for the next message
    (a dashboard that quits, or a test that closes its follower, would wait that long)."""
    server = BatchtopServer(served[0].loop, served[0].subscription._bus)
    front = ServerThread(server).start()
    source = RemoteSource(front.url).start()
    try:
        _wait(lambda: source.connected)
        time.sleep(0.2)                                 # the reader is in its read: nothing more to send
        began = time.monotonic()
        source.close()
        assert time.monotonic() - began < 1.0 and not source._thread.is_alive()
    finally:
        front.stop()


def _wait(condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _poll_until(source, condition, timeout: float = 15.0) -> list:
    events, deadline = [], time.monotonic() + timeout
    while True:
        events += source.poll().events
        if condition(events):
            return events
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
