"""The API under abuse (engine/reliability/abuse.py): every case as expected, no 5xx, the engine serves on."""
from __future__ import annotations

import time

from server_helpers import API_KEY, wait_idle

from batchtop.engine.reliability.abuse import run_cases

FLOOD = 2000


def test_abuse_cases_get_4xx_never_5xx(keyed):
    server, thread = keyed
    report = run_cases(thread.url, API_KEY, server.model_name, server.engine.max_model_len,
                       server.max_body_bytes, flood=FLOOD)
    print(report.text())
    assert report.problems == [] and report.num_5xx == 0
    assert len(report.cases) == 10 and report.num_requests > FLOOD + 100
    by_name = {case.name: case for case in report.cases}
    # past --max-waiting (1024 by default) the flood is refused with 429 + Retry-After, never lost
    flood = by_name[f"{FLOOD} tiny requests at once"].statuses
    assert set(flood) <= {200, 429} and flood[200] + flood[429] == FLOOD and flood[200] >= 1024
    assert by_name["bodies at and over the size limit (413)"].statuses[413] == 4
    pages = by_name["browser origins and rebinding Host names"].statuses
    assert pages == {403: 4 * 8, 421: 4 * 9, 200: 3}, pages
    wait_idle(server)
    # the engine thread releases a finished request after handing out its output, a moment after idle
    deadline = time.monotonic() + 10
    while (server.engine.requests or server.router._pending) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server.engine.requests and not server.router._pending


def test_the_key_is_compared_in_constant_time(keyed, monkeypatch):
    import hmac

    import httpx
    compared = []
    real = hmac.compare_digest

    def spy(given, expected):
        compared.append((given, expected))
        return real(given, expected)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    url = keyed[1].url
    assert httpx.post(url + "/v1/pause", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert compared == [(b"Bearer nope", f"Bearer {API_KEY}".encode())]
