"""The dashboard over HTTP: a `Source` that follows a `batchtop serve` server.

A background thread reads the server's event stream (`GET /v1/events`, server-sent events)
with httpx and httpx-sse. Each event's SSE id is its sequence number on the server; after a lost
connection the thread reconnects with exponential backoff and sends `Last-Event-ID`, so
the stream resumes exactly after the last event seen. If the server's history no longer
reaches back that far, the server says so (`event: gap`) and this source hands the
dashboard an `EventsDropped`; if the server itself was restarted (a new `server_id`), the
dashboard starts over (`Poll.reset`).

Commands go to the control endpoints and return the server's error message, or None.
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import httpx
from httpx_sse import connect_sse

from batchtop.telemetry.events import SCHEMA_VERSION, EnginePaused, EngineResumed, EventsDropped, KnobChanged
from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS, Knob
from batchtop.telemetry.protocol.stream import stream_schema
from batchtop.telemetry.recorder import decode_event

from .base import Poll, Source, SourceDescription, disconnected


class RemoteSource(Source):
    kind = "remote"
    commands_block = True

    def __init__(self, url: str, api_key: str | None = None, *, backoff_s: tuple[float, float] = (0.5, 8.0),
                 timeout_s: float = 5.0, read_timeout_s: float = 30.0, from_step: int | None = 0,
                 notify: Callable[[], None] | None = None):
        super().__init__()
        self.notify = notify                   # called on the stream's thread when polling has news
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.backoff_s = backoff_s
        self.from_step = from_step             # first connection: the history the server still holds
        self._timeout = httpx.Timeout(timeout_s, read=read_timeout_s)
        self._control = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout_s)
        self._lock = threading.Lock()
        self._pending: list = []
        self._reset = False
        self._knob_table: list[Knob] | None = None     # the server's knob rows, once it sent them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: httpx.Response | None = None
        self.connected = False
        self.last_error: str | None = None
        self.retry_at: float | None = None
        self.last_seq: int | None = None
        self.server_id: str | None = None
        self.num_connects = 0
        self._paused = False
        self._clock_offset: float | None = None   # server monotonic - ours, best (largest) estimate
        self._schema = SCHEMA_VERSION             # the events' schema, as the stream's hello says
        self.meta = {"model": None, "device": f"remote {self.url}"}
        self._load_knobs()

    # -- state ------------------------------------------------------------------------------

    def _load_knobs(self) -> None:
        try:
            response = self._control.get("/v1/knobs")
        except httpx.HTTPError as error:
            self.last_error = f"{type(error).__name__}: {error}"
            return
        if response.status_code == 200:
            self._apply_state(response.json())
        else:
            self.last_error = _message(response)

    def _apply_state(self, state: dict) -> None:
        rows = state.get("knob_table")
        if isinstance(rows, list):
            self._knob_table = [_knob_of(row) for row in rows if isinstance(row, dict)]
        knobs = dict(state.get("knobs") or {})
        if "block_size" in state:
            knobs["block_size"] = state["block_size"]
        self.knobs = knobs
        self._paused = bool(state.get("paused"))
        self.meta = {**self.meta, "model": state.get("model"),
                     "preemption_mode": knobs.get("preemption_mode"),
                     "engine": state.get("engine_setup")}    # a recording's header `engine` entry
        engine = state.get("engine")        # another engine's facts (batchtop's scheduler inside vLLM)
        if engine:
            self.meta.update(device=engine, slots=state.get("slots"),
                             lock_step=state.get("data_parallel_lock_step"),
                             **{k: state[k] for k in ("batching_mode", "layout",
                                                      "preemption_mode") if k in state})

    @property
    def paused(self) -> bool:
        return self._paused

    def now(self) -> float | None:
        """The server's clock, estimated from event arrival (events carry server monotonic times)."""
        return None if self._clock_offset is None else time.monotonic() + self._clock_offset

    def status(self) -> str:
        if self.connected:
            return f"{'paused' if self._paused else 'live'} · {self.url}"
        return disconnected(self.url, self.last_error, self.retry_at)

    # -- the stream thread -------------------------------------------------------------------

    def start(self) -> RemoteSource:
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="batchtop-remote", daemon=True)
            self._thread.start()
        return self

    def poll(self) -> Poll:
        with self._lock:
            events, self._pending = self._pending, []
            reset, self._reset = self._reset, False
        return Poll(events, reset)

    def _follow(self) -> None:
        delay = self.backoff_s[0]
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=self._timeout) as client:
            while not self._stop.is_set():
                try:
                    if self._read_stream(client):
                        delay = self.backoff_s[0]      # it had worked: start the backoff over
                except (httpx.HTTPError, OSError, ValueError) as error:
                    name = type(error).__name__
                    self.last_error = f"{name}: {error}" if str(error) else name
                self.connected = False
                self._response = None
                if self._stop.is_set():
                    break
                self.retry_at = time.monotonic() + delay
                self._stop.wait(delay)
                self.retry_at = None
                delay = min(delay * 2, self.backoff_s[1])

    def _read_stream(self, client: httpx.Client) -> bool:
        """Follow one connection until it ends; True when it delivered the hello."""
        headers, params = {}, {}
        if self.last_seq is not None:
            headers["Last-Event-ID"] = str(self.last_seq)
        elif self.from_step is not None:
            params["from_step"] = self.from_step
        greeted = False
        with connect_sse(client, "GET", "/v1/events", headers=headers, params=params) as source:
            response = source.response
            if response.status_code != 200:
                response.read()
                self.last_error = f"HTTP {response.status_code}: {_message(response)}"
                return False
            self._response = response
            for message in source.iter_sse():
                if self._stop.is_set():
                    return greeted
                if message.event == "hello":
                    greeted = True
                    if not self._hello(message.json()):
                        return True            # a new server: reconnect from its start
                elif message.event == "gap":
                    self._gap(message.json())
                elif message.event == "message" and message.data:     # no data: a keep-alive
                    self._event(message.data, message.id or None)
        self.last_error = "the server closed the stream"
        return greeted

    def _hello(self, hello: dict) -> bool:
        """False when the server is not the one we followed (restarted): start over from its history."""
        restarted = self.server_id is not None and hello.get("server_id") != self.server_id
        if restarted and self.last_seq is not None:
            self.server_id, self.last_seq = hello.get("server_id"), None
            return False
        self._schema = stream_schema(hello, self.url)
        first = self.server_id is None
        self.server_id = hello.get("server_id")
        self._apply_state(hello)
        self.connected, self.last_error = True, None
        self.num_connects += 1
        if first or self.last_seq is None:
            with self._lock:
                self._pending, self._reset = [], True
            if self.notify is not None:
                self.notify()
        return True

    def _gap(self, notice: dict) -> None:
        self.last_error = notice.get("message")
        lost = notice.get("lost") or 0
        with self._lock:
            last_t = self._pending[-1].t if self._pending else 0.0
            self._pending.append(EventsDropped(step=notice.get("oldest_step") or 0, t=last_t,
                                               count=int(lost)))

    def _event(self, data: str, event_id: str | None) -> None:
        event = decode_event(data, self._schema)
        offset = event.t - time.monotonic()
        if self._clock_offset is None or offset > self._clock_offset:
            self._clock_offset = offset
        kind = type(event)
        if kind is EnginePaused or kind is EngineResumed:
            self._paused = kind is EnginePaused
        elif kind is KnobChanged:
            self.knobs[event.name] = event.new
        with self._lock:
            first = not self._pending
            self._pending.append(event)
        if event_id is not None:
            self.last_seq = int(event_id)
        if first and self.notify is not None:
            self.notify()

    # -- commands ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict | None = None) -> str | None:
        try:
            response = self._control.post(path, json=body)
        except httpx.HTTPError as error:
            return f"{self.url} unreachable: {type(error).__name__}"
        return None if response.status_code == 200 else _message(response)

    def describe(self) -> SourceDescription:
        """The knobs are the server's own table (its `knob_table`: vLLM's knobs with vLLM's limits; a
        server that sends none is offered the scheduler knobs every engine has). Pause, step and abort
        go to its control endpoints."""
        if self._knob_table is None:
            knobs = dict(SCHEDULER_KNOBS)
        else:
            knobs = {k.name: k for k in self._knob_table if k.dashboard}
        return SourceDescription(self.kind, can=frozenset({"pause", "step", "abort"}), knobs=knobs, why_not={
            "record": "the dashboard over a server does not record; the in-process engine does "
                      "(batchtop --record LOG)",
            "scenarios": "scenarios run on the in-process engine (batchtop --scenario NAME)"})

    def set_knob(self, name: str, value) -> str | None:
        return self._post("/v1/knobs", {"name": name, "value": value})

    def pause(self) -> str | None:
        error = self._post("/v1/pause")
        self._paused = self._paused or error is None
        return error

    def resume(self) -> str | None:
        error = self._post("/v1/resume")
        self._paused = self._paused and error is not None
        return error

    def toggle_pause(self) -> str | None:
        return self.resume() if self._paused else self.pause()

    def step_once(self) -> str | None:
        return self._post("/v1/step")

    def abort(self, request_id: str) -> str | None:
        return self._post(f"/v1/requests/{request_id}/abort")

    def request_snapshot(self) -> str | None:
        """The server's EngineSnapshot on this stream before its next step."""
        return self._post("/v1/snapshot")

    def close(self) -> None:
        """Stop following at once: the reader thread waits in a read of the stream (a quiet server sends
        a keep-alive every 10 s), and only shutting the socket down ends a read another thread is in
        (closing it does not)."""
        self._stop.set()
        response = self._response
        if response is not None:
            connection = response.extensions.get("network_stream")
            sock = connection.get_extra_info("socket") if connection is not None else None
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:             # the server closed it first
                pass
        if self._thread is not None:
            self._thread.join(5)
        self._control.close()


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def _knob_of(row: dict) -> Knob:
    """A knob row of a server's hello or GET /v1/knobs."""
    kind = {"int": int, "float": float}.get(row.get("type"), str)
    low, high = row.get("limits") or (0, None)
    name = str(row.get("name"))
    return Knob(name, kind, str(row.get("help") or ""), str(row.get("label") or name),
                low=low, high=high, choices=tuple(row.get("choices") or ()),
                applies=str(row.get("applies") or "next step"), dashboard=bool(row.get("dashboard")))
