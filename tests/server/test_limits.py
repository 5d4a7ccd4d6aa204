"""batchtop serve's bounded work: --max-waiting answers 429 with Retry-After, --max-prompts-per-request
400, and neither refusal touches what is already in flight."""
from __future__ import annotations

import threading
import time

import httpx

from batchtop.engine.server.app import ServerThread
from batchtop.engine.server.host import BatchtopServer


def test_waiting_and_prompt_caps_refuse_new_work_and_lose_nothing(served):
    server, _ = served
    limited = BatchtopServer(server.loop, server.subscription._bus, max_waiting=2, max_prompts=2)
    answers: list[httpx.Response] = []
    with ServerThread(limited) as front, httpx.Client(base_url=front.url, timeout=60) as http:
        body = {"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4, "ignore_eos": True}
        assert http.post("/v1/pause").status_code == 200
        try:
            def send():
                answers.append(http.post("/v1/completions", json=body))
            senders = [threading.Thread(target=send) for _ in range(2)]
            for sender in senders:
                sender.start()
            deadline = time.monotonic() + 30
            while server.loop.num_waiting < 2:
                assert time.monotonic() < deadline, "the two requests never waited"
                time.sleep(0.02)
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["code"] == "too_many_waiting" and "--max-waiting" in error["message"]
            many = http.post("/v1/completions", json={**body, "prompt": [[1, 2], [3, 4], [5, 6]]})
            assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_prompts"
        finally:
            assert http.post("/v1/resume").status_code == 200
        for sender in senders:
            sender.join(60)
    assert [a.status_code for a in answers] == [200, 200]
    assert all(a.json()["usage"]["completion_tokens"] == 4 for a in answers)
