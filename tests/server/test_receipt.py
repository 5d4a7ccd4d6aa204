"""A completion arrives when the server receives it: its TTFT counts from the HTTP receipt, and the time
the server then spends on it before the engine has it (reading, checking, parsing, tokenizing) is
recorded as RequestArrived.input_s."""
from __future__ import annotations

import time

import httpx

from batchtop.telemetry import events as ev

TOKENIZE_S = 0.08          # a slow tokenizer: time spent on the input path


def test_ttft_counts_from_the_receipt_and_the_input_path_is_recorded(served, monkeypatch):
    server, thread = served
    engine = server.engine
    tokenize = engine.tokenize

    def slow_tokenize(prompt, chat=False):
        time.sleep(TOKENIZE_S)
        return tokenize(prompt, chat)
    monkeypatch.setattr(engine, "tokenize", slow_tokenize)
    bus = server.subscription._bus
    with bus.subscribe() as sub, httpx.Client(base_url=thread.url, timeout=60) as client:
        assert client.get("/health").status_code == 200          # connected: the send below is the request's
        sent = time.monotonic()
        answer = client.post("/v1/completions",
                             json={"model": server.model_name, "prompt": "receipt", "max_tokens": 2})
        answered = time.monotonic()
        assert answer.status_code == 200, answer.text
        request_id = answer.json()["id"]
        deadline = time.monotonic() + 10
        events: list = []
        while not any(isinstance(e, ev.FirstToken) and e.request_id == request_id for e in events):
            assert time.monotonic() < deadline, events
            events += sub.drain()
            time.sleep(0.01)
    arrived = next(e for e in events if isinstance(e, ev.RequestArrived) and e.request_id == request_id)
    first = next(e for e in events if isinstance(e, ev.FirstToken) and e.request_id == request_id)
    assert sent <= arrived.arrival_t <= sent + 0.05         # stamped on receipt, before the tokenizer ran
    assert TOKENIZE_S <= arrived.input_s <= arrived.since_arrival_s
    assert arrived.arrival_t + arrived.input_s <= arrived.t <= answered
    # the first token's time (the scheduler's, at the step's update) lies within the step that made it,
    # counted from the receipt (FirstToken.t is stamped after the update: 1-3 ms later on a loaded host)
    planned = next(e for e in events if isinstance(e, ev.StepPlanned) and e.step == first.step)
    assert planned.t <= arrived.arrival_t + first.ttft_s <= first.t + 1e-6
    assert first.ttft_s >= TOKENIZE_S                       # the client's wait, the tokenizer's included


def test_the_engine_s_own_requests_have_no_input_path(served):
    server, _ = served
    request = server.engine.make_request([5, 6, 7], arrival_time=time.monotonic() - 0.5)
    assert request.input_s == 0.0 and time.monotonic() - request.arrival_time >= 0.5
    received = server.engine.make_request([5, 6, 7], received_time=time.monotonic() - 0.5)
    assert received.input_s >= 0.5 and received.arrival_time + received.input_s <= time.monotonic()
