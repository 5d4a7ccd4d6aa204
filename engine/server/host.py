"""`BatchtopServer`: one running `EngineLoop` as the protocol's host, with the OpenAI API beside it.

The engine runs on its `EngineLoop` thread; this module never touches it directly except
through the loop (add_request, abort, commands) and read-only looks (knobs, tokenizer, pool
sizes). Events come in through a bus subscription, drained into the event ring and the
metrics on the asyncio thread as soon as they are published (at most every 10 ms).
"""
from __future__ import annotations

import time

from batchtop.engine.core.knobs import KNOBS
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.whatif.recording import engine_header
from batchtop.telemetry import events as ev
from batchtop.telemetry.protocol.errors import ApiError
from batchtop.telemetry.protocol.guard import AccessRules
from batchtop.telemetry.protocol.limits import MAX_BODY_BYTES, MAX_PROMPTS, MAX_WAITING
from batchtop.telemetry.protocol.routes import ControlHost
from batchtop.telemetry.protocol.stream import EventRing

from .completions import Completions
from .outputs import OutputRouter
from .prometheus import ServerMetrics


class BatchtopServer(ControlHost):
    """The app and its state around one running `EngineLoop` whose engine publishes to `bus`."""

    knob_table = KNOBS

    def __init__(self, loop: EngineLoop, bus, *, model_name: str | None = None, api_key: str | None = None,
                 event_history: int = 100_000, max_body_bytes: int = MAX_BODY_BYTES, host: str = "127.0.0.1",
                 allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (),
                 max_waiting: int = MAX_WAITING, max_prompts: int = MAX_PROMPTS):
        super().__init__()
        from .app import build_app
        self.loop = loop
        self.commands = loop.commands
        self.engine = loop.engine
        self.capacity = self.engine.batch.capacity
        self.model_name = model_name or self.engine.config.model
        self.rules = AccessRules(api_key=api_key or None, bound_host=host, allowed_hosts=tuple(allowed_hosts),
                                 allowed_origins=tuple(allowed_origins), max_body_bytes=max_body_bytes)
        self.api_key = self.rules.api_key
        self.max_body_bytes = max_body_bytes
        self.tokenizer = self.engine.tokenizer
        self.created = int(time.time())
        self.subscription = bus.subscribe(maxlen=max(event_history, 200_000), notify=self.wake_pump)
        self.ring = EventRing(event_history)
        self.metrics = ServerMetrics(self.model_name, knobs=self.engine.knobs())
        self.router = OutputRouter()
        self.paused = loop.paused
        self.completions = Completions(loop, self.router, self.model_name, self.check_engine,
                                       max_waiting=max_waiting, max_prompts=max_prompts)
        self.app = build_app(self)

    def pump(self) -> None:
        """Move newly published events into the ring and the metrics (asyncio thread)."""
        events = self.subscription.drain()
        if events:
            if type(events[0]) is ev.EventsDropped:
                self.request_snapshot("drop")
            self.ring.extend(events)
            self.metrics.feed(events)

    def check_engine(self) -> None:
        if not self.loop.running:
            raise ApiError(503, f"the engine is not running ({self.loop.error!r})", type="server_error",
                           code="engine_stopped")

    # -- the protocol's host interface ---------------------------------------------------------

    def knob_values(self) -> dict:
        return dict(self.engine.knobs())

    def describe(self) -> dict:
        engine = self.engine
        return {"block_size": engine.config.block_size, "num_kv_blocks": engine.kv.num_blocks,
                "max_model_len": engine.max_model_len, "model": self.model_name,
                "engine_setup": engine_header(engine)}

    def health(self) -> tuple[int, dict]:
        if not self.loop.running:
            return 503, {"status": "engine stopped", "error": repr(self.loop.error)}
        return super().health()

    def apply_knob(self, name: str, value, source: str) -> None:
        self.engine.set_knob(name, value, source)

    def refuse(self, command: str, message: str) -> None:
        self.engine.refuse(command, message)

    def emit_snapshot(self, cause: str) -> None:
        self.engine.emit_snapshot(cause)

    def abort(self, request_id: str) -> dict:
        request = self.engine.requests.get(request_id)
        if request is None or request.finished:
            raise ApiError(404, f"no unfinished request with id {request_id!r}", param="request_id",
                           code="request_not_found")
        self._queue(self.loop.abort, request_id)
        return {"id": request_id, "aborted": True}
