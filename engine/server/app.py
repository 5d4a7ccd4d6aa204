"""FastAPI over the engine's public methods: the OpenAI API, metrics, events and control.

The engine runs on its `EngineLoop` thread; this module never touches it directly except
through the loop (add_request, abort, set_knob, pause, resume, step_once) and read-only
looks (knobs, tokenizer). Outputs come back through per-request callbacks on the engine
thread; `OutputRouter` queues them and wakes the asyncio loop once per batch of outputs.

Endpoints: /v1/completions, /v1/chat/completions (SSE with `stream`), /v1/models, /health,
/metrics (Prometheus), /v1/events (SSE telemetry, resumable), /v1/knobs (GET, POST),
/v1/pause, /v1/resume, /v1/step, /v1/requests/{id}/abort. See docs/server.md.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import signal
import threading
import time
import uuid
from collections import deque
from typing import Union

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchtop.engine.core.knobs import KNOBS, ranges
from batchtop.engine.core.loop import EngineLoop
from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry import events as ev
from batchtop.telemetry import flight
from batchtop.telemetry.stream import (
    SSE_HEADERS,
    BearerAuth,
    EventRing,
    bind_socket,
    check_bind,
    error_body,
    events_response,
)

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServerMetrics
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    KnobUpdate,
    TextStream,
    message_text,
    stop_strings,
)

PUMP_INTERVAL_S = 0.05
GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6          # the sampler compares in float32: 5e-324 would become 0 and drop every token
MAX_BODY_BYTES = 2 * 2**20   # a 128k-token prompt as token ids is ~1 MB of JSON
DRAIN_BYTES = 16 * 2**20     # an oversized body is read and dropped up to this, so its client reads the 413
ERROR_RESPONSES = {code: {"description": text, "content": {"application/json": {}}}
                   for code, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                                      (404, "unknown model, route or request"))}


class _Pending:
    """One engine request as the asyncio side sees it."""
    __slots__ = ("request_id", "tokens", "finished", "reason", "wake")

    def __init__(self, request_id: str, wake: asyncio.Event):
        self.request_id = request_id
        self.tokens: list[int] = []
        self.finished = False
        self.reason: str | None = None
        self.wake = wake


class OutputRouter:
    """Engine-thread callbacks in, per-request token lists on the asyncio side.

    `push` (engine thread) appends to a deque and schedules one `_dispatch` per burst, so a
    step with 32 outputs costs one wakeup of the asyncio loop, not 32.
    """

    def __init__(self):
        self.aloop: asyncio.AbstractEventLoop | None = None
        self._inbox: deque = deque()
        self._scheduled = False
        self._pending: dict[str, _Pending] = {}

    def open(self, request_id: str, wake: asyncio.Event) -> _Pending:
        pending = self._pending[request_id] = _Pending(request_id, wake)
        return pending

    def close(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def push(self, output) -> None:
        """Engine thread: must never raise (it would end the engine) nor block."""
        self._inbox.append(output)
        if not self._scheduled:
            self._scheduled = True
            try:
                self.aloop.call_soon_threadsafe(self._dispatch)
            except (RuntimeError, AttributeError):   # the HTTP side is gone or not started: nobody waits
                self._scheduled = False
                self._inbox.clear()

    def _dispatch(self) -> None:
        self._scheduled = False
        inbox, pending = self._inbox, self._pending
        while inbox:
            output = inbox.popleft()
            p = pending.get(output.request_id)
            if p is None or p.finished:
                continue
            p.tokens.extend(output.new_token_ids)
            if output.finished:
                p.finished, p.reason = True, output.finish_reason
            p.wake.set()


class BatchtopServer:
    """The app and its state around one running `EngineLoop` whose engine publishes to `bus`."""

    def __init__(self, loop: EngineLoop, bus, *, model_name: str | None = None, api_key: str | None = None,
                 event_history: int = 100_000, max_body_bytes: int = MAX_BODY_BYTES):
        self.loop = loop
        self.max_body_bytes = max_body_bytes
        self.engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.model_name = model_name or self.engine.config.model
        self.api_key = api_key or None
        self.server_id = uuid.uuid4().hex[:12]
        self.created = int(time.time())
        self.subscription = bus.subscribe(maxlen=max(event_history, 200_000))
        self.ring = EventRing(event_history)
        self.metrics = ServerMetrics(self.model_name, knobs=self.engine.knobs())
        self.router = OutputRouter()
        self.paused = loop.paused
        self.closing = False          # set on shutdown: endless event streams end so the server can stop
        self._ids = itertools.count()
        self.app = build_app(self)

    # -- plumbing --------------------------------------------------------------------------

    def pump(self) -> None:
        """Move newly published events into the ring and the metrics (asyncio thread)."""
        events = self.subscription.drain()
        if events:
            if type(events[0]) is ev.EventsDropped:
                self.loop.request_snapshot("drop")
            self.ring.extend(events)
            self.metrics.feed(events)

    async def run_pump(self) -> None:
        while True:
            self.pump()
            await asyncio.sleep(PUMP_INTERVAL_S)

    def check_engine(self) -> None:
        if not self.loop.running:
            raise ApiError(503, f"the engine is not running ({self.loop.error!r})", type="server_error",
                           code="engine_stopped")

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404,
                           f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    # -- generation ------------------------------------------------------------------------

    def _sampling(self, body, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_BELOW:
            temperature = 0.0       # as vLLM: a vanishing temperature is greedy (and 1e-40 would give NaNs)
        return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              top_p=1.0 if body.top_p is None else max(body.top_p, MIN_TOP_P),
                              top_k=max(0, body.top_k or 0), seed=body.seed, ignore_eos=bool(body.ignore_eos))

    def _prompts(self, body, chat: bool) -> list[list[int]]:
        try:
            if chat:
                messages = [{"role": m.role, "content": message_text(m.content)} for m in body.messages]
                return [self.engine.tokenize(messages, chat=True)]
            prompt = body.prompt
            if isinstance(prompt, str):
                return [self.engine.tokenize(prompt)]
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            if isinstance(prompt[0], str):
                return [self.engine.tokenize(p) for p in prompt]
            if isinstance(prompt[0], int):
                return [list(prompt)]
            return [list(p) for p in prompt]
        except ApiError:
            raise
        except Exception as error:          # a template or tokenizer failure is the input's fault
            raise ApiError(400, f"cannot tokenize the {'messages' if chat else 'prompt'}: {error}",
                           param="messages" if chat else "prompt") from None

    def _submit(self, body, chat: bool) -> tuple[list[_Pending], list[TextStream], list[int], asyncio.Event]:
        self.check_model(body.model)
        self.check_engine()
        stops = stop_strings(body.stop)
        prompts = self._prompts(body, chat)
        wake = asyncio.Event()
        pendings, texts = [], []
        prefix = "chatcmpl" if chat else "cmpl"
        try:
            for ids in prompts:
                max_tokens = (body.max_completion_tokens or body.max_tokens) if chat else body.max_tokens
                if max_tokens is None:
                    max_tokens = max(1, self.engine.max_model_len - len(ids))
                request_id = f"{prefix}-{next(self._ids)}"
                pending = self.router.open(request_id, wake)
                try:
                    self.loop.add_request(ids, self._sampling(body, max_tokens), on_output=self.router.push,
                                          request_id=request_id)
                except ValueError as error:
                    self.router.close(request_id)
                    message = str(error)
                    code = "context_length_exceeded" if "exceeds" in message else None
                    param = "max_tokens" if code else ("messages" if chat else "prompt")
                    raise ApiError(400, message, param=param, code=code) from None
                pendings.append(pending)
                texts.append(TextStream(self.tokenizer, stops))
        except ApiError:
            self._abort_all(pendings)
            raise
        return pendings, texts, [len(ids) for ids in prompts], wake

    def _abort_all(self, pendings: list[_Pending]) -> None:
        for p in pendings:
            if not p.finished:
                self.loop.abort(p.request_id)
            self.router.close(p.request_id)

    def _take(self, p: _Pending, text: TextStream) -> None:
        """Feed new tokens to the detokenizer; a stop string ends the request here."""
        if p.tokens:
            tokens, p.tokens = p.tokens, []
            text.add(tokens)
        if text.stopped and not p.finished:
            p.finished, p.reason = True, "stop"
            self.loop.abort(p.request_id)           # the rest would be thrown away: free the row now

    async def generate(self, body, request: Request, chat: bool):
        pendings, texts, prompt_lens, wake = self._submit(body, chat)
        if body.stream:
            return StreamingResponse(self._stream(body, chat, pendings, texts, prompt_lens, wake),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            while True:
                for p, t in zip(pendings, texts):
                    self._take(p, t)
                if all(p.finished for p in pendings):
                    break
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), 1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return PlainTextResponse("", status_code=499)
                    self.check_engine()
        finally:
            self._abort_all(pendings)
        return JSONResponse(self._full_response(body, chat, pendings, texts, prompt_lens))

    def _usage(self, texts, prompt_lens) -> dict:
        prompt = sum(prompt_lens)
        completion = sum(t.num_tokens for t in texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _full_response(self, body, chat, pendings, texts, prompt_lens) -> dict:
        choices = []
        for i, (p, t) in enumerate(zip(pendings, texts)):
            text = t.finish()
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None, "finish_reason": p.reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": p.reason})
        return {"id": pendings[0].request_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": choices,
                "usage": self._usage(texts, prompt_lens)}

    async def _stream(self, body, chat, pendings, texts, prompt_lens, wake):
        request_id = pendings[0].request_id
        created = int(time.time())
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}
        dumps = json.dumps
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        done = [False] * len(pendings)
        try:
            if chat:
                yield "data: " + dumps({**head,
                                        "choices": [{"index": 0,
                                                     "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None,
                                                            "finish_reason": None}]}) + "\n\n"
            while not all(done):
                out = []
                for i, (p, t) in enumerate(zip(pendings, texts)):
                    if done[i]:
                        continue
                    had_tokens = bool(p.tokens)
                    self._take(p, t)
                    if p.finished:
                        delta, reason, done[i] = t.finish(), p.reason, True
                    elif had_tokens:
                        delta, reason = t.delta(), None
                    else:
                        continue
                    choice = ({"index": i, "delta": {"content": delta} if delta or not reason else {},
                               "logprobs": None, "finish_reason": reason} if chat else
                              {"index": i, "text": delta, "logprobs": None, "finish_reason": reason})
                    out.append("data: " + dumps({**head, "choices": [choice]}) + "\n\n")
                if out:
                    yield "".join(out)
                    continue
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), 5.0)
                except asyncio.TimeoutError:
                    self.check_engine()
            if include_usage:
                yield "data: " + dumps({**head, "choices": [],
                                        "usage": self._usage(texts, prompt_lens)}) + "\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as error:
            yield "data: " + dumps(error.body()) + "\n\ndata: [DONE]\n\n"
        finally:
            # A client that went away lands here too (the task is cancelled): free its KV blocks.
            self._abort_all(pendings)

    # -- control ----------------------------------------------------------------------------

    def knobs(self) -> dict:
        return {"knobs": dict(self.engine.knobs()), "ranges": ranges(self.engine.batch.capacity),
                "paused": self.paused,
                "block_size": self.engine.config.block_size, "num_kv_blocks": self.engine.kv.num_blocks,
                "max_model_len": self.engine.max_model_len, "model": self.model_name}

    def set_knob(self, update: KnobUpdate) -> dict:
        error = self.loop.set_knob(update.name, update.value, "api")
        if error is not None:
            param = "value" if update.name in KNOBS else "name"
            raise ApiError(400, error, param=param, code="invalid_knob")
        return {"name": update.name, "value": self.engine.validate_knob(update.name, update.value),
                "applied": "before the next step"}

    def set_paused(self, paused: bool) -> dict:
        (self.loop.pause if paused else self.loop.resume)()
        self.paused = paused
        return {"paused": paused}

    def step(self) -> dict:
        if not self.paused:
            raise ApiError(409, "the engine is running: pause it first, then step", code="not_paused")
        self.loop.step_once()
        return {"paused": True, "steps_granted": 1}

    def abort(self, request_id: str) -> dict:
        request = self.engine.requests.get(request_id)
        if request is None or request.finished:
            raise ApiError(404, f"no unfinished request with id {request_id!r}", param="request_id",
                           code="request_not_found")
        self.loop.abort(request_id)
        return {"id": request_id, "aborted": True}

    def hello(self) -> dict:
        return {"server_id": self.server_id, **self.knobs(), "oldest_seq": self.ring.oldest_seq,
                "next_seq": self.ring.next_seq}


class BodyLimit:
    """Pure ASGI middleware: a request body over `max_bytes` gets 413 before the app sees it.

    The body is read here (the routes read it whole anyway) and handed on; messages after it
    (a client's disconnect) pass through untouched. An oversized body is read on and thrown
    away up to `DRAIN_BYTES`, so the client, still sending, gets to read its 413; past that the
    connection is closed on it.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send, size=0, more=True)
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":      # the client left before its body arrived
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send, size, more)
        body, delivered = b"".join(parts), False

        async def replay():
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, size: int, more: bool):
        while more and size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        response = JSONResponse(error_body(f"the request body is over the limit of {self.max_bytes} bytes",
                                           code="request_too_large"),
                                status_code=413, headers={"Connection": "close"} if more else None)
        await response(scope, receive, send)


def build_app(server: BatchtopServer) -> FastAPI:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        server.router.aloop = asyncio.get_running_loop()
        server.ring._changed = asyncio.Event()
        pump = asyncio.create_task(server.run_pump())
        yield
        pump.cancel()

    app = FastAPI(title="batchtop", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible serving, telemetry events and live control of a batchtop "
                              "engine")
    app.add_middleware(BodyLimit, max_bytes=server.max_body_bytes)
    if server.api_key:                   # outermost: a request without the key is refused unread
        app.add_middleware(BearerAuth, api_key=server.api_key)
    _add_error_handlers(app)

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        return await server.generate(body, request, chat=False)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.generate(body, request, chat=True)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models():
        return {"object": "list",
                "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "batchtop",
                                            "max_model_len": server.engine.max_model_len}]}

    @app.get("/health", responses=ERROR_RESPONSES)
    async def health():
        if not server.loop.running:
            return JSONResponse({"status": "engine stopped", "error": repr(server.loop.error)},
                                status_code=503)
        return {"status": "ok", "paused": server.paused}

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
    async def metrics():
        server.pump()
        return Response(server.metrics.exposition(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/events", responses=ERROR_RESPONSES,
             description="Server-sent telemetry events; each `id:` is the event's seq. Resume with "
                         "`Last-Event-ID` (exact) or `from_step`; an `event: gap` says when the point is "
                         "older than the server's history.")
    async def events(request: Request, from_step: Union[int, None] = Query(None, ge=0, le=2**62)):
        server.pump()
        try:
            return events_response(server.ring, request.headers.get("last-event-id"), from_step,
                                   server.hello(), closing=lambda: server.closing,
                                   on_join=lambda: server.loop.request_snapshot("subscribe"))
        except ValueError as error:
            raise ApiError(400, str(error), param="Last-Event-ID") from None

    @app.get("/v1/knobs", responses=ERROR_RESPONSES)
    async def get_knobs():
        return server.knobs()

    @app.post("/v1/knobs", responses=ERROR_RESPONSES)
    async def post_knob(update: KnobUpdate):
        return server.set_knob(update)

    @app.post("/v1/pause", responses=ERROR_RESPONSES)
    async def pause():
        return server.set_paused(True)

    @app.post("/v1/resume", responses=ERROR_RESPONSES)
    async def resume():
        return server.set_paused(False)

    @app.post("/v1/step", responses={**ERROR_RESPONSES, 409: {"description": "not paused"}})
    async def step():
        return server.step()

    @app.post("/v1/requests/{request_id}/abort", responses=ERROR_RESPONSES)
    async def abort(request_id: str):
        return server.abort(request_id)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

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
                 event_history: int = 100_000, max_body_bytes: int = MAX_BODY_BYTES,
                 loaded=None) -> BatchtopServer:
    """Load the model, start the engine loop, and wrap it (the HTTP side is not started)."""
    from batchtop.engine.core.engine import Engine
    from batchtop.telemetry.bus import EventBus
    bus = EventBus()
    engine = Engine(config, sink=bus.publish, loaded=loaded)
    loop = EngineLoop(engine)
    server = BatchtopServer(loop, bus, model_name=model_name, api_key=api_key, event_history=event_history,
                            max_body_bytes=max_body_bytes)
    loop.start()
    return server


def uvicorn_server(server: BatchtopServer, *, log_level: str = "warning", access_log: bool = False):
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):          # Ctrl+C: end the event streams first
            server.closing = True
            flight.dump_all(f"signal {signal.Signals(sig).name}")    # uvicorn's handler replaces the CLI's
            super().handle_exit(sig, frame)

    config = uvicorn.Config(server.app, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=3, timeout_keep_alive=30)
    return Server(config)


def serve(server: BatchtopServer, host: str = "127.0.0.1", port: int = 8000, *,
          access_log: bool = False) -> None:
    """Bind (after the loopback rule) and serve until interrupted."""
    check_bind(host, server.api_key)
    sock = bind_socket(host, port)
    try:
        uvicorn_server(server, access_log=access_log).run(sockets=[sock])
    finally:
        server.loop.stop()


class ServerThread:
    """uvicorn in a background thread on a port of its own (tests, benchmarks)."""

    def __init__(self, server: BatchtopServer, host: str = "127.0.0.1", port: int = 0):
        check_bind(host, server.api_key)
        self.server = server
        self.sock = bind_socket(host, port)
        bound = self.sock.getsockname()
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        self.uvicorn = uvicorn_server(server)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]},
                                       name="batchtop-http", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.server.closing = False
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.closing = True
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.sock.close()
        self.server.closing = False    # the same BatchtopServer may be served again

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
