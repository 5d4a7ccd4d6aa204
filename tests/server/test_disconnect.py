"""A client that goes away mid-stream aborts its request; its KV blocks return to the pool."""
from __future__ import annotations

import threading
import time

import httpx
from server_helpers import NUM_KV_BLOCKS, wait_idle


def stream_in_thread(base_url: str, body: dict, chunks: list, close: threading.Event) -> threading.Thread:
    """Open the stream, append each data line to `chunks`, hang up once `close` is set."""
    def read():
        with httpx.Client(base_url=base_url, timeout=30) as client:
            with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        chunks.append(line)
                    if close.is_set():
                        break                 # leaving the block closes the connection mid-stream
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_disconnect_mid_stream_frees_blocks(served, base_url):
    server, _ = served
    wait_idle(server)
    server.pump()
    aborted_before = server.metrics.finished["abort"]
    body = {"model": "tiny", "prompt": list(range(1000, 1100)), "max_tokens": 150, "stream": True}
    chunks: list[str] = []
    close = threading.Event()
    server.set_paused(True)                   # the test steps the engine: the request cannot end by itself
    try:
        reader = stream_in_thread(base_url, body, chunks, close)
        deadline = time.monotonic() + 20
        while len(chunks) < 3 and time.monotonic() < deadline:
            seen = len(chunks)
            server.loop.step_once()
            step_deadline = min(deadline, time.monotonic() + 0.5)
            while len(chunks) == seen and time.monotonic() < step_deadline:
                time.sleep(0.01)              # a step that only prefilled sends nothing
        assert len(chunks) >= 3
        assert server.engine.kv.num_used_blocks > 0          # it holds blocks while it runs
        close.set()
        server.loop.step_once()               # one more token wakes the reader, which hangs up
        reader.join(10)
        assert not reader.is_alive()
        deadline = time.monotonic() + 5
        while server.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.02)                  # the abort is served while the engine stays paused
        assert not server.engine.has_unfinished()
        assert server.engine.kv.num_free_blocks == NUM_KV_BLOCKS
    finally:
        server.set_paused(False)
    wait_idle(server)
    server.pump()
    assert server.metrics.finished["abort"] == aborted_before + 1      # aborted, not run to the end


def test_disconnect_of_non_streaming_request(served, base_url):
    server, _ = served
    wait_idle(server)
    server.set_paused(True)                   # the request waits, the client gives up
    try:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 50}
        try:
            httpx.post(base_url + "/v1/completions", json=body, timeout=0.5)
        except httpx.TimeoutException:
            pass
        deadline = time.monotonic() + 5
        while server.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)                  # the server notices within ~1 s, while still paused
        assert not server.engine.has_unfinished()
        assert server.engine.kv.num_free_blocks == NUM_KV_BLOCKS
    finally:
        server.set_paused(False)
    wait_idle(server)                         # aborted on the disconnect, or finished: the pool is whole
    assert server.engine.kv.num_free_blocks == NUM_KV_BLOCKS

