"""The event stream over HTTP: the history ring and server-sent events with resume.

Every server that publishes batchtop's events (`batchtop serve`, and batchtop's scheduler
inside vLLM) speaks this protocol, so one client (`batchtop top --url`) follows either.
The framing, keep-alive comments and disconnect handling are sse-starlette's (vLLM installs
it too, so this module loads inside vLLM's engine process).

Every telemetry event gets a sequence number (`seq`, from 1, without holes) as it enters
a bounded ring; the SSE `id:` of an event is its seq, so a client that reconnects with
`Last-Event-ID: <seq>` gets exactly the events after it: no gap, no duplicate. A client may
instead ask `?from_step=N` (every event of step N onwards). When the requested point has
already left the ring the stream says so first (`event: gap`) and continues from the oldest
event kept. The ring is used from the server's asyncio thread only.
"""
from __future__ import annotations

import asyncio
import json

from sse_starlette import EventSourceResponse, ServerSentEvent

from ..events import SCHEMA_VERSION, Event
from ..recorder import SUPPORTED_SCHEMA_VERSIONS, encode_event

SSE_HEADERS = {"Cache-Control": "no-cache"}
SCHEMA_BEFORE_HELLOS_SAID = 3         # a hello without `schema_version`: a server of schema 3 or older
SSE_SEP = "\n"
HEARTBEAT_S = 10.0


class EventRing:
    def __init__(self, maxlen: int):
        if maxlen < 1:
            raise ValueError(f"event history must be >= 1, got {maxlen}")
        self.maxlen = maxlen
        self._events: list[Event | None] = [None] * maxlen
        self._lines: list[str | None] = [None] * maxlen     # encoded on first read
        self.next_seq = 1
        self._changed = asyncio.Event()

    @property
    def oldest_seq(self) -> int:
        return max(1, self.next_seq - self.maxlen)

    def __len__(self) -> int:
        return self.next_seq - self.oldest_seq

    def serve_on_this_loop(self) -> None:
        """Waiters belong to the asyncio loop that serves the ring: call from a new loop before it serves
        (a server started again runs a new loop)."""
        self._changed = asyncio.Event()

    def extend(self, events: list[Event]) -> None:
        if not events:
            return
        for event in events:
            i = self.next_seq % self.maxlen
            self._events[i] = event
            self._lines[i] = None
            self.next_seq += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def event(self, seq: int) -> Event:
        return self._events[seq % self.maxlen]

    def line(self, seq: int) -> str:
        i = seq % self.maxlen
        line = self._lines[i]
        if line is None:
            line = self._lines[i] = encode_event(self._events[i])
        return line

    def seq_of_step(self, step: int) -> int:
        """The seq of the first kept event with step >= `step` (next_seq if none): steps never decrease."""
        lo, hi = self.oldest_seq, self.next_seq
        while lo < hi:
            mid = (lo + hi) // 2
            if self.event(mid).step < step:
                lo = mid + 1
            else:
                hi = mid
        return lo

    async def wait_beyond(self, seq: int, timeout: float) -> bool:
        """Wait until an event with seq >= `seq` exists; False on timeout."""
        if self.next_seq > seq:
            return True
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return self.next_seq > seq


def sse(data: str, *, event: str | None = None, id: int | None = None) -> bytes:
    """One server-sent event, framed by sse-starlette (lines end in LF, as before)."""
    return ServerSentEvent(data, event=event, id=None if id is None else str(id), sep=SSE_SEP).encode()


def resolve_start(ring: EventRing, last_event_id: str | None,
                  from_step: int | None) -> tuple[int, dict | None]:
    """Where a stream starts (a seq) and the gap notice to send first, if any."""
    oldest = ring.oldest_seq
    if last_event_id is not None:
        start = int(last_event_id) + 1
        if start > ring.next_seq:          # an id from an earlier server run: go live
            return ring.next_seq, None
        requested = {"requested_seq": start}
    elif from_step is not None:
        if ring.next_seq == oldest or ring.event(oldest).step <= from_step:
            return ring.seq_of_step(from_step), None
        start = oldest                      # steps before the oldest kept one are gone (or never seen)
        requested = {"requested_step": from_step}
    else:
        return ring.next_seq, None
    if start > oldest or (start == oldest and last_event_id is not None):
        return start, None
    oldest_step = ring.event(oldest).step if ring.next_seq > oldest else None
    notice = {**requested, "oldest_seq": oldest, "oldest_step": oldest_step, "lost": oldest - start
              if last_event_id is not None else None,
              "message": "the requested point is older than the server's event history; "
                         "continuing from the oldest event kept"}
    return oldest, notice


async def event_stream(ring: EventRing, start: int, hello: dict, notice: dict | None, *,
                       batch: int = 2000, closing=lambda: False):
    """SSE: `hello`, maybe `gap`, then every event from `start` on, each with its seq as id.

    Events ready together go out as one chunk (up to `batch` of them). Ends when `closing()`
    turns true (the server shuts down), so a shutdown need not wait for it.
    """
    yield sse(json.dumps({**hello, "start_seq": start}), event="hello")
    if notice is not None:
        yield sse(json.dumps(notice), event="gap")
    seq = start
    while not closing():
        if seq < ring.oldest_seq:           # this client fell behind the ring
            notice = {"requested_seq": seq, "oldest_seq": ring.oldest_seq, "lost": ring.oldest_seq - seq,
                      "message": "this stream fell behind the server's event history; events were lost"}
            yield sse(json.dumps(notice), event="gap")
            seq = ring.oldest_seq
        end = min(ring.next_seq, seq + batch)
        if end > seq:
            yield b"".join(sse(ring.line(s), id=s) for s in range(seq, end))
            seq = end
            await asyncio.sleep(0)
        else:
            await ring.wait_beyond(seq, 0.5)


def events_response(ring: EventRing, last_event_id: str | None, from_step: int | None, hello: dict, *,
                    closing=lambda: False, heartbeat_s: float | None = None,
                    on_join=None) -> EventSourceResponse:
    """The `GET /v1/events` answer; ValueError when `Last-Event-ID` is not an event seq. `on_join()` is
    called when the stream joins live or after a gap (the client holds no exact state: the engine
    should publish a snapshot).

    sse-starlette sends a `: keep-alive` comment every `heartbeat_s` (default HEARTBEAT_S; clients
    detect dead peers) and ends the stream when the client goes away or uvicorn shuts down. A client
    library may hand a keep-alive on as a message without data (httpx-sse does, with the last id):
    clients skip those."""
    if last_event_id is not None and not last_event_id.strip().isdigit():
        raise ValueError(f"Last-Event-ID must be an event seq (an integer), got {last_event_id!r}")
    start, notice = resolve_start(ring, last_event_id.strip() if last_event_id else None, from_step)
    if on_join is not None and (notice is not None or start == ring.next_seq):
        on_join()
    return EventSourceResponse(event_stream(ring, start, hello, notice, closing=closing), headers=SSE_HEADERS,
                               sep=SSE_SEP, ping=HEARTBEAT_S if heartbeat_s is None else heartbeat_s,
                               ping_message_factory=_keep_alive)


def _keep_alive() -> ServerSentEvent:
    return ServerSentEvent(comment="keep-alive", sep=SSE_SEP)


def stream_schema(hello: dict, url: str = "the server") -> int:
    """The event schema a stream's `hello` says its events are written in (decode each with
    `decode_event(data, version)`, which upgrades an older one); ValueError, saying what to do, for one
    this batchtop cannot read."""
    version = hello.get("schema_version", SCHEMA_BEFORE_HELLOS_SAID)
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ValueError(f"{url} writes events in schema version {version!r}; this batchtop reads versions "
                         f"{min(SUPPORTED_SCHEMA_VERSIONS)} to {SCHEMA_VERSION}: upgrade batchtop")
    return version
