"""The FastAPI app of `batchtop serve` and how it runs: the OpenAI API, metrics, and the protocol's
event and control routes (telemetry/protocol) over a `BatchtopServer`.

Endpoints: /v1/completions, /v1/chat/completions (SSE with `stream`), /v1/models, /health,
/metrics (Prometheus), and the protocol's /v1/events (SSE telemetry, resumable), /v1/knobs (GET,
POST), /v1/pause, /v1/resume, /v1/step, /v1/requests/{id}/abort. See docs/server.md.
"""
from __future__ import annotations

import asyncio
import signal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchtop.telemetry import flight
from batchtop.telemetry.protocol import runner
from batchtop.telemetry.protocol.errors import ApiError, error_body
from batchtop.telemetry.protocol.limits import MAX_BODY_BYTES
from batchtop.telemetry.protocol.routes import lifespan, mount

from .completions import ReceiptStamp
from .host import BatchtopServer
from .openai_api import ChatCompletionRequest, CompletionRequest
from .prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE

ERROR_RESPONSES = {code: {"description": text, "content": {"application/json": {}}}
                   for code, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                                      (403, "a web origin that is not allowed"),
                                      (404, "unknown model, route or request"),
                                      (421, "a Host that is not this server's"), (429, "too many waiting"))}


def build_app(server: BatchtopServer) -> FastAPI:
    def on_start():
        server.router.aloop = asyncio.get_running_loop()

    app = FastAPI(title="batchtop", version="0.1.0", lifespan=lifespan(server, on_start),
                  description="OpenAI-compatible serving, telemetry events and live control of a batchtop "
                              "engine")
    mount(app, server, server.rules, ERROR_RESPONSES)
    app.add_middleware(ReceiptStamp)        # the outermost: a completion's arrival is its receipt
    _add_error_handlers(app)
    completions = server.completions

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions_route(body: CompletionRequest, request: Request):
        return await completions.generate(body, request, chat=False)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await completions.generate(body, request, chat=True)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        return {"object": "list",
                "data": [{"id": server.model_name, "object": "model", "created": server.created,
                          "owned_by": "batchtop", "max_model_len": server.engine.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def metrics():
        server.pump()
        return Response(server.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        errors = error.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
        if first.get("type") == "json_invalid":
            loc = []
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        else:
            where = ".".join(loc) or "body"
            message = f"{where}: {first.get('msg', 'invalid request')}"
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
        return JSONResponse(error_body(message, param=loc[0] if loc else None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return JSONResponse(error_body(str(error.detail), code=code), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request, error: Exception):      # a bug: still an OpenAI-shaped body
        return JSONResponse(error_body(f"internal error: {error!r}", type="server_error"), status_code=500)


# -- running ------------------------------------------------------------------------------------


def build_server(config, *, api_key: str | None = None, model_name: str | None = None,
                 event_history: int = 100_000, max_body_bytes: int = MAX_BODY_BYTES, loaded=None,
                 **limits) -> BatchtopServer:
    """Load the model, start the engine loop, and wrap it (the HTTP side is not started). `limits`:
    BatchtopServer's host, allowed_hosts, allowed_origins, max_waiting, max_prompts."""
    from batchtop.engine.core.engine import Engine
    from batchtop.engine.core.loop import EngineLoop
    from batchtop.telemetry.bus import EventBus
    bus = EventBus()
    engine = Engine(config, sink=bus.publish, loaded=loaded)
    loop = EngineLoop(engine)
    server = BatchtopServer(loop, bus, model_name=model_name, api_key=api_key, event_history=event_history,
                            max_body_bytes=max_body_bytes, **limits)
    loop.start()
    return server


def serve(server: BatchtopServer, host: str = "127.0.0.1", port: int = 8000, *,
          access_log: bool = False) -> None:
    """Bind (after the loopback rule) and serve until interrupted."""
    def on_exit(sig):                      # Ctrl+C: end the event streams first
        server.closing = True
        if sig is not None:
            flight.dump_all(f"signal {signal.Signals(sig).name}")    # uvicorn's handler replaces the CLI's
    try:
        runner.serve_forever(server.app, host, port, api_key=server.api_key, on_exit=on_exit,
                             access_log=access_log)
    finally:
        server.loop.stop()


class ServerThread(runner.ServerThread):
    """A `BatchtopServer` served from a background thread on a port of its own (tests, benchmarks);
    the same server may be served again after `stop()`."""

    def __init__(self, server: BatchtopServer, host: str = "127.0.0.1", port: int = 0):
        self.server = server
        super().__init__(server.app, host, port, api_key=server.api_key, on_exit=self._closing)

    def _closing(self, sig) -> None:
        self.server.closing = True

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.server.closing = False
        return super().start(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self.server.closing = False
