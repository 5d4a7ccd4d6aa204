"""The OpenAI API over the engine loop: prompts in, sampling params, outputs as JSON or SSE.

Requests reach the engine only through `EngineLoop.add_request` and `abort`; outputs come back
through the server's `OutputRouter`. Bounded: a body with more than `max_prompts` prompts gets
400, and while `max_waiting` requests wait for admission new ones get 429 with `Retry-After`
(nothing in flight is touched by either refusal).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from batchtop.engine.core.sampling import SamplingParams
from batchtop.telemetry.protocol.commands import QueueFull
from batchtop.telemetry.protocol.errors import ApiError
from batchtop.telemetry.protocol.limits import MAX_PROMPTS, MAX_WAITING, RETRY_AFTER_S
from batchtop.telemetry.protocol.stream import SSE_HEADERS

from .openai_api import TextStream, message_text, stop_strings
from .outputs import OutputRouter, _Pending

GREEDY_BELOW = 1e-5
MIN_TOP_P = 1e-6          # the sampler compares in float32: 5e-324 would become 0 and drop every token
RECEIVED = "batchtop.received_time"     # the ASGI scope's key for ReceiptStamp's stamp


class ReceiptStamp:
    """Pure ASGI middleware, the outermost: stamps when a request reached the server (time.monotonic()),
    before its body is read, checked, parsed and tokenized. That is a completion's arrival, the time its
    TTFT counts from (as vLLM's API server stamps it); what follows until the engine has it is recorded
    as the request's input path (RequestArrived.input_s)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope[RECEIVED] = time.monotonic()
        await self.app(scope, receive, send)


class Completions:
    """/v1/completions and /v1/chat/completions for one `EngineLoop`."""

    def __init__(self, loop, router: OutputRouter, model_name: str, check_engine, *,
                 max_waiting: int = MAX_WAITING, max_prompts: int = MAX_PROMPTS):
        self.loop = loop
        self.engine = loop.engine
        self.tokenizer = self.engine.tokenizer
        self.router = router
        self.model_name = model_name
        self.check_engine = check_engine
        self.max_waiting = max_waiting
        self.max_prompts = max_prompts
        self._ids = itertools.count()

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise ApiError(404,
                           f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def check_room(self, num_prompts: int) -> None:
        if num_prompts > self.max_prompts:
            raise ApiError(400, f"a request may carry at most {self.max_prompts} prompts, this one has "
                                f"{num_prompts} (--max-prompts-per-request)", param="prompt",
                           code="too_many_prompts")
        waiting = self.loop.num_waiting
        if waiting + num_prompts > self.max_waiting:
            raise ApiError(429, f"{waiting} requests wait for admission (at most {self.max_waiting}, "
                                "--max-waiting): try again shortly", type="server_error",
                           code="too_many_waiting", headers={"Retry-After": str(RETRY_AFTER_S)})

    def _sampling(self, body, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature < GREEDY_BELOW:
            temperature = 0.0       # as vLLM: a vanishing temperature is greedy (and 1e-40 would give NaNs)
        return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                              top_p=1.0 if body.top_p is None else max(body.top_p, MIN_TOP_P),
                              top_k=max(0, body.top_k or 0), seed=body.seed, ignore_eos=bool(body.ignore_eos))

    def _prompts(self, body, chat: bool) -> list[list[int]]:
        prompt = None if chat else body.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        self.check_room(len(prompt) if many else 1)
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

    def _submit(self, body, chat: bool, received_time: float | None = None
                ) -> tuple[list[_Pending], list[TextStream], list[int], asyncio.Event]:
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
                                          request_id=request_id, received_time=received_time)
                except QueueFull as full:
                    self.router.close(request_id)
                    raise ApiError(503, str(full), type="server_error", code="engine_busy",
                                   headers={"Retry-After": str(RETRY_AFTER_S)}) from None
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
        pendings, texts, prompt_lens, wake = self._submit(body, chat, request.scope.get(RECEIVED))
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
