"""The event and control routes, one APIRouter over a small host interface both servers implement.

Routes: GET /health, GET /v1/events (SSE, resumable: stream.py), GET and POST /v1/knobs,
POST /v1/pause, /v1/resume, /v1/step, /v1/snapshot, /v1/requests/{id}/abort. A host (`batchtop serve`'s
engine loop, batchtop's scheduler inside vLLM) says what its knobs are (`Knob` rows), queues
commands on its `CommandQueue`, and moves its events into its `EventRing`; everything the
routes answer is built here, so both servers answer alike. While `failure` is set (batchtop's
part inside vLLM switched itself off) /health, /v1/knobs and the hello carry the reason and
commands are refused with 503 instead of queueing what would never apply.
"""
from __future__ import annotations

import asyncio
import uuid
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from typing import Callable, Union

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..events import SCHEMA_VERSION
from .commands import CommandQueue, QueueFull
from .errors import ApiError
from .guard import AccessRules, Guard
from .knob import Knob, describe_knobs, lookup
from .limits import RETRY_AFTER_S
from .stream import EventRing, events_response

PUMP_INTERVAL_S = 0.05      # the pump's period when nothing wakes it
PUMP_GAP_S = 0.01           # and its shortest: at most 100 pumps a second however often it is woken


class KnobUpdate(BaseModel):
    """Checked by the host's knob table on its way to the engine, not here: a refusal then names the
    allowed values in the table's words."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., description="a knob of GET /v1/knobs")
    value: Union[bool, int, float, str] = Field(..., description="GET /v1/knobs: `ranges` says what each "
                                                                 "knob takes")


class ControlHost(ABC):
    """What the routes need of a server. Subclasses set `commands`, `ring` and `knob_table`."""

    commands: CommandQueue
    ring: EventRing
    knob_table: dict[str, Knob]
    capacity: int | None = None          # the upper limit of knobs whose `high` is None
    where = ""                           # said in an unknown knob's message (" on vLLM")

    def __init__(self):
        self.server_id = uuid.uuid4().hex[:12]
        self.paused = False              # as the API last set it (the engine applies it before its next step)
        self.closing = False             # set on shutdown: endless event streams end so the server can stop
        self._pump_loop: asyncio.AbstractEventLoop | None = None
        self._pump_woken: asyncio.Event | None = None
        self._wake_sent = False          # one wakeup in flight at a time

    # -- what a host supplies ----------------------------------------------------------------

    @abstractmethod
    def knob_values(self) -> dict:
        """Every knob's current value."""

    @abstractmethod
    def describe(self) -> dict:
        """The rest of GET /v1/knobs: model, pool, engine kind."""

    @abstractmethod
    def apply_knob(self, name: str, value, source: str) -> None:
        """Engine thread: set a knob already checked against `knob_table`, and announce it."""

    @abstractmethod
    def refuse(self, command: str, message: str) -> None:
        """Engine thread: record a command that was refused (a CommandRefused event)."""

    @abstractmethod
    def emit_snapshot(self, cause: str) -> None:
        """Engine thread: publish every live request's state."""

    @abstractmethod
    def pump(self) -> None:
        """Move newly published events into `ring` (the server's asyncio thread)."""

    def abort(self, request_id: str) -> dict:
        raise ApiError(501, "this server cannot abort requests", code="not_supported")

    def health(self) -> tuple[int, dict]:
        if self.failure is not None:
            return 503, {"status": "batchtop off", "batchtop_failure": self.failure}
        return 200, {"status": "ok", "paused": self.paused}

    @property
    def failure(self) -> str | None:
        """None while batchtop's part works; why it switched itself off otherwise."""
        return None

    # -- built here ------------------------------------------------------------------------

    def knobs(self) -> dict:
        return {"knobs": self.knob_values(), **describe_knobs(self.knob_table, self.capacity),
                "paused": self.paused, "batchtop_failure": self.failure, **self.describe()}

    def hello(self) -> dict:
        """The stream's first message: the server, its knobs, its history and its events' schema."""
        return {"server_id": self.server_id, "schema_version": SCHEMA_VERSION, **self.knobs(),
                "oldest_seq": self.ring.oldest_seq, "next_seq": self.ring.next_seq}

    def check_working(self) -> None:
        if self.failure is not None:
            raise ApiError(503, f"batchtop's part is off ({self.failure}): commands would never apply",
                           type="server_error", code="batchtop_off")

    def submit(self, command: Callable[[], None], key: str | None = None) -> None:
        self._queue(self.commands.submit, command, key)

    def _queue(self, call, *args) -> None:
        try:
            call(*args)
        except QueueFull as full:        # nothing was queued; what is queued stays
            raise ApiError(503, str(full), type="server_error", code="command_queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def set_knob(self, name: str, value, source: str = "api") -> dict:
        self.check_working()
        try:
            value = lookup(self.knob_table, name, self.where).parse(value, self.capacity)
        except ValueError as error:
            message = str(error)
            self.submit(lambda: self.refuse(f"set {name}", message))
            raise ApiError(400, message, param="value" if name in self.knob_table else "name",
                           code="invalid_knob") from None
        self.submit(lambda: self.apply_knob(name, value, source))
        return {"name": name, "value": value, "applied": f"before the {self.knob_table[name].applies}"}

    def set_paused(self, paused: bool) -> dict:
        self.check_working()
        self._queue(self.commands.pause if paused else self.commands.resume)
        self.paused = paused
        return {"paused": paused}

    def step(self) -> dict:
        self.check_working()
        if not self.paused:
            raise ApiError(409, "the engine is running: pause it first, then step", code="not_paused")
        self._queue(self.commands.step_once)
        return {"paused": True, "steps_granted": 1}

    def snapshot(self) -> dict:
        """POST /v1/snapshot: every live request's state on the stream before the next step (a recording
        that begins on a running engine starts from it)."""
        self.check_working()
        self.submit(lambda: self.emit_snapshot("request"), key="snapshot")
        return {"snapshot": "before the next step"}

    def request_snapshot(self, cause: str) -> None:
        """Before the next step, one snapshot; asks while one waits coalesce into it."""
        if self.failure is not None:
            return
        try:
            self.commands.submit(lambda: self.emit_snapshot(cause), key="snapshot")
        except QueueFull:
            pass                         # the engine is behind: the joining client waits for the next one

    def wake_pump(self) -> None:
        """Any thread, never blocks: events wait to be pumped. The engine's event buffer calls it when an
        event lands in it empty (its `notify`), so an event reaches the streams within one pump gap of
        being published rather than within the pump's period."""
        loop, woken = self._pump_loop, self._pump_woken
        if self._wake_sent or loop is None:
            return
        self._wake_sent = True
        try:
            loop.call_soon_threadsafe(woken.set)
        except RuntimeError:             # the server's loop has closed: nobody pumps any more
            pass

    async def run_pump(self) -> None:
        woken = asyncio.Event()
        self._pump_woken, self._pump_loop = woken, asyncio.get_running_loop()
        while True:
            woken.clear()
            self._wake_sent = False      # before draining: an event published after the drain wakes us again
            self.pump()
            await asyncio.sleep(PUMP_GAP_S)
            try:
                await asyncio.wait_for(woken.wait(), PUMP_INTERVAL_S)
            except asyncio.TimeoutError:
                pass


def protocol_router(host: ControlHost, responses: dict | None = None) -> APIRouter:
    router = APIRouter()
    responses = responses or {}

    def answer(fn, *args):
        try:
            return fn(*args)
        except ApiError as error:
            return error.response()

    @router.get("/health", responses=responses)
    async def health():
        status, body = host.health()
        return body if status == 200 else JSONResponse(body, status_code=status)

    @router.get("/v1/events", responses=responses,
                description="Server-sent telemetry events; each `id:` is the event's seq. Resume with "
                            "`Last-Event-ID` (exact) or `from_step`; an `event: gap` says when the point is "
                            "older than the server's history.")
    async def events(request: Request, from_step: Union[int, None] = Query(None, ge=0, le=2**62)):
        host.pump()
        try:
            return events_response(host.ring, request.headers.get("last-event-id"), from_step, host.hello(),
                                   closing=lambda: host.closing,
                                   on_join=lambda: host.request_snapshot("subscribe"))
        except ValueError as error:
            return ApiError(400, str(error), param="Last-Event-ID").response()

    @router.get("/v1/knobs", responses=responses)
    async def get_knobs():
        return host.knobs()

    @router.post("/v1/knobs", responses=responses)
    async def post_knob(update: KnobUpdate):
        return answer(host.set_knob, update.name, update.value)

    @router.post("/v1/pause", responses=responses)
    async def pause():
        return answer(host.set_paused, True)

    @router.post("/v1/resume", responses=responses)
    async def resume():
        return answer(host.set_paused, False)

    @router.post("/v1/step", responses={**responses, 409: {"description": "not paused"}})
    async def step():
        return answer(host.step)

    @router.post("/v1/snapshot", responses=responses,
                 description="An EngineSnapshot on the event stream before the next step.")
    async def snapshot():
        return answer(host.snapshot)

    @router.post("/v1/requests/{request_id}/abort", responses=responses)
    async def abort(request_id: str):
        return answer(host.abort, request_id)

    return router


def lifespan(host: ControlHost, on_start: Callable[[], None] | None = None):
    """The app's lifespan: the ring served on this loop, the pump running while the app runs."""
    @asynccontextmanager
    async def run(app):
        host.ring.serve_on_this_loop()
        if on_start is not None:
            on_start()
        pump = asyncio.create_task(host.run_pump())
        yield
        pump.cancel()
    return run


def mount(app: FastAPI, host: ControlHost, rules: AccessRules, responses: dict | None = None) -> None:
    """The access rules around the whole app, and the protocol's routes in it."""
    app.add_middleware(Guard, rules=rules)
    app.include_router(protocol_router(host, responses))
