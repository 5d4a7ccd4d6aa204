"""batchtop's side endpoint inside vLLM's engine process: the protocol of `batchtop serve`'s
event and control routes, so `batchtop top --url`, `record` and `replay` work unchanged.

Routes: GET /health, GET /v1/events (SSE, resumable: telemetry/stream.py), GET and POST
/v1/knobs, POST /v1/pause, /v1/resume, /v1/step. Aborting a request is vLLM's API's job
(a client that closes its connection); /v1/requests/{id}/abort says so.

Listens on $BATCHTOP_EVENTS_HOST (default 127.0.0.1) at the port the scheduler gives (the
base port + the data-parallel rank). Without $BATCHTOP_EVENTS_API_KEY only loopback may be
bound; with it every request needs `Authorization: Bearer KEY`. uvicorn runs on a daemon
thread with its own asyncio loop; events cross from the engine thread through the
scheduler's EventLog, drained here every 50 ms.
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Union

import vllm
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from vllm.logger import init_logger

from batchtop.telemetry.stream import (
    BearerAuth,
    EventRing,
    bind_socket,
    check_bind,
    error_body,
    events_response,
)

PUMP_INTERVAL_S = 0.05
EVENT_HISTORY = 100_000
logger = init_logger(f"vllm.{__name__}")      # through vLLM's log handler


class KnobUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    value: Union[int, float, str]


class SideEndpoint:
    def __init__(self, scheduler, host: str, port: int, api_key: str | None):
        self.scheduler = scheduler
        self.controls = scheduler.batchtop_controls
        self.host, self.port, self.api_key = host, port, api_key or None
        self.server_id = uuid.uuid4().hex[:12]
        self.ring = EventRing(EVENT_HISTORY)
        self.closing = False
        self.app = self._build_app()
        self._uvicorn = None
        self._thread: threading.Thread | None = None

    # -- state ------------------------------------------------------------------------------

    def pump(self) -> None:
        self.ring.extend(self.scheduler.batchtop_events.drain())

    def resync(self) -> None:
        """A client joins live or after a gap: the scheduler publishes a snapshot before its next step."""
        scheduler = self.scheduler
        self.controls.call_between_steps(lambda: scheduler.batchtop_snapshot("subscribe"))

    def knobs(self) -> dict:
        s = self.scheduler
        model = s.vllm_config.model_config.served_model_name
        return {"knobs": self.controls.knobs(), "paused": self.controls.paused, "block_size": s.block_size,
                "num_kv_blocks": s.kv_cache_manager.block_pool.num_gpu_blocks - 1,
                "max_model_len": s.max_model_len,
                "model": model[0] if isinstance(model, (list, tuple)) else model,
                "engine": f"vllm {vllm.__version__}", "scheduler": type(s).__name__,
                "data_parallel_rank": s._batchtop_rank(), "slots": "mirrored", "layout": "condense",
                "batching_mode": "continuous", "preemption_mode": "recompute",
                "knob_limits": {r.name: [r.low, r.high] for r in self.controls.rules.values()}}

    def hello(self) -> dict:
        return {"server_id": self.server_id, **self.knobs(), "oldest_seq": self.ring.oldest_seq,
                "next_seq": self.ring.next_seq}

    # -- the app ----------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        endpoint = self

        @asynccontextmanager
        async def lifespan(app):
            endpoint.ring._changed = asyncio.Event()       # bound to this thread's loop

            async def run_pump():
                while True:
                    endpoint.pump()
                    await asyncio.sleep(PUMP_INTERVAL_S)
            pump = asyncio.create_task(run_pump())
            yield
            pump.cancel()

        app = FastAPI(title="batchtop inside vLLM", lifespan=lifespan,
                      description="batchtop's telemetry events and live knobs from vLLM's scheduler")
        if self.api_key:
            app.add_middleware(BearerAuth, api_key=self.api_key)

        def error(status: int, message: str, code: str | None = None, param: str | None = None):
            return JSONResponse(error_body(message, param=param, code=code), status_code=status)

        @app.get("/health")
        async def health():
            return {"status": "ok", "engine": f"vllm {vllm.__version__}", "paused": endpoint.controls.paused,
                    "data_parallel_rank": endpoint.scheduler._batchtop_rank()}

        @app.get("/v1/events")
        async def events(request: Request, from_step: Union[int, None] = Query(None, ge=0, le=2**62)):
            endpoint.pump()
            try:
                return events_response(endpoint.ring, request.headers.get("last-event-id"), from_step,
                                       endpoint.hello(), closing=lambda: endpoint.closing,
                                       on_join=endpoint.resync)
            except ValueError as bad:
                return error(400, str(bad), param="Last-Event-ID")

        @app.get("/v1/knobs")
        async def get_knobs():
            return endpoint.knobs()

        @app.post("/v1/knobs")
        async def post_knob(update: KnobUpdate):
            message = endpoint.controls.set_knob(update.name, update.value, "api")
            if message is not None:
                return error(400, message, code="invalid_knob",
                             param="name" if message.startswith("unknown knob") else "value")
            return {"name": update.name, "value": endpoint.controls.validate(update.name, update.value),
                    "applied": "before the next step"}

        @app.post("/v1/pause")
        async def pause():
            endpoint.controls.pause()
            return {"paused": True}

        @app.post("/v1/resume")
        async def resume():
            endpoint.controls.resume()
            return {"paused": False}

        @app.post("/v1/step")
        async def step():
            if not endpoint.controls.paused:
                return error(409, "vLLM is running: pause it first, then step", code="not_paused")
            endpoint.controls.step_once()
            return {"paused": True, "steps_granted": 1}

        @app.post("/v1/requests/{request_id}/abort")
        async def abort(request_id: str):
            return error(501,
                         "batchtop cannot abort a request inside vLLM: vLLM's API server owns it (a client "
                              "that closes its connection aborts it)", code="not_supported")

        return app

    # -- life ---------------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SideEndpoint:
        import uvicorn
        check_bind(self.host, self.api_key)
        sock = bind_socket(self.host, self.port)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=3)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]},
                                        name="batchtop-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"batchtop's endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.closing = True
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(5)


def start_endpoint(scheduler, port: int) -> SideEndpoint:
    host = os.environ.get("BATCHTOP_EVENTS_HOST", "127.0.0.1")
    endpoint = SideEndpoint(scheduler, host, port, os.environ.get("BATCHTOP_EVENTS_API_KEY")).start()
    logger.info("batchtop: events and knobs of data-parallel rank %d on http://%s:%d (batchtop top --url)",
                scheduler._batchtop_rank(), host, port)
    return endpoint
