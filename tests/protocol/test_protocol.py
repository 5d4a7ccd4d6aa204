"""One protocol, two hosts: every test runs against `batchtop serve` and against batchtop's side endpoint
inside vLLM's real Scheduler. Knobs read, set and refused; pause, step, resume; the event stream resumed
by Last-Event-ID; the Host, Origin, key and body rules."""
from __future__ import annotations

import json
import time

import pytest
from protocol_helpers import ALLOWED_HOST, ALLOWED_ORIGIN, API_KEY, MAX_BODY_BYTES


def knobs(host) -> dict:
    with host.client() as c:
        response = c.get("/v1/knobs")
    assert response.status_code == 200, response.text
    return response.json()


def wait_knob(host, name: str, value, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while knobs(host)["knobs"][name] != value:
        assert time.monotonic() < deadline, f"{name} never became {value}"
        time.sleep(0.05)


def test_knobs_are_described_with_their_limits(host):
    state = knobs(host)
    table = {row["name"]: row for row in state["knob_table"]}
    assert {"max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold"} <= set(table)
    assert table["max_num_seqs"]["label"] == "seqs" and table["max_num_seqs"]["applies"] == "next step"
    limit = state["knob_limits"]["max_num_seqs"]
    assert limit[0] == 1 and limit[1] == (8 if host.kind == "vllm" else 256)
    assert state["batchtop_failure"] is None and state["paused"] is False


def test_a_knob_is_set_before_the_next_step_and_refused_outside_its_range(host):
    with host.client() as c:
        ok = c.post("/v1/knobs", json={"name": "max_num_seqs", "value": 4})
        assert ok.status_code == 200, ok.text
        assert ok.json() == {"name": "max_num_seqs", "value": 4, "applied": "before the next step"}
        host.add(1)                          # an idle vLLM applies commands before its next schedule()
        wait_knob(host, "max_num_seqs", 4)
        too_high = c.post("/v1/knobs", json={"name": "max_num_seqs", "value": 9999})
        assert too_high.status_code == 400
        error = too_high.json()["error"]
        limit = 8 if host.kind == "vllm" else 256
        assert error["message"].startswith(f"max_num_seqs must be an integer in [1, {limit}], got 9999")
        if host.kind == "vllm":
            assert "8 is the value vLLM started with" in error["message"]
        assert (error["code"], error["param"]) == ("invalid_knob", "value")
        unknown = c.post("/v1/knobs", json={"name": "turbo", "value": 1}).json()["error"]
        assert unknown["param"] == "name" and "unknown knob 'turbo'" in unknown["message"]
        back = c.post("/v1/knobs", json={"name": "max_num_seqs", "value": host.max_num_seqs})
        assert back.status_code == 200
        host.add(1)
        wait_knob(host, "max_num_seqs", host.max_num_seqs)


def test_pause_step_resume(host):
    with host.client() as c:
        refused = c.post("/v1/step")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_paused"
        assert c.post("/v1/pause").json() == {"paused": True}
        assert knobs(host)["paused"] is True
        assert c.post("/v1/step").json() == {"paused": True, "steps_granted": 1}
        assert c.post("/v1/resume").json() == {"paused": False}
        assert c.get("/health").json()["paused"] is False


def _read_events(host, headers: dict, count: int, on_hello=None) -> tuple[dict, list[tuple[int, dict]]]:
    """The hello and the first `count` events (seq, data) of one connection; `on_hello()` runs once the
    stream is open (so what it causes is streamed live)."""
    hello, events = None, []
    with host.client() as c, c.stream("GET", "/v1/events", headers=headers) as response:
        assert response.status_code == 200
        kind, seq = None, None
        for line in response.iter_lines():
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("id:"):
                seq = int(line.split(":", 1)[1])
            elif line.startswith("data:"):
                data = json.loads(line.split(":", 1)[1])
                if kind == "hello":
                    hello = data
                    if on_hello is not None:
                        on_hello()
                elif kind is None:
                    events.append((seq, data))
                kind, seq = None, None
                if len(events) >= count:
                    break
    return hello, events


def test_the_event_stream_resumes_exactly_after_the_last_event_id(host):
    hello, first = _read_events(host, {}, 3, on_hello=lambda: host.add(2))
    assert hello["server_id"] and "knob_table" in hello and hello["batchtop_failure"] is None
    last = first[-1][0]
    _, resumed = _read_events(host, {"Last-Event-ID": str(last)}, 2)
    assert [seq for seq, _ in resumed] == [last + 1, last + 2]


@pytest.mark.parametrize("header", ["evil.example", "evil.example:80", "127.0.0.1.evil.example"])
def test_a_rebinding_host_is_refused(host, header):
    with host.client() as c:
        for method, path in (("GET", "/v1/knobs"), ("GET", "/v1/events"), ("POST", "/v1/pause")):
            response = c.request(method, path, headers={"Host": header})
            assert response.status_code == 421, (method, path, response.text)
            assert response.json()["error"]["code"] == "host_not_allowed"
    assert knobs(host)["paused"] is False


@pytest.mark.parametrize("header", ["localhost", "LOCALHOST:1234", "127.0.0.1", "[::1]:9", ALLOWED_HOST])
def test_own_and_allowed_hosts_pass(host, header):
    with host.client() as c:
        assert c.get("/v1/knobs", headers={"Host": header}).status_code == 200


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://localhost:1"])
def test_a_forged_origin_cannot_control_or_read(host, origin):
    with host.client() as c:
        for method, path in (("POST", "/v1/pause"), ("POST", "/v1/step"), ("GET", "/v1/events"),
                             ("GET", "/v1/knobs")):
            response = c.request(method, path, headers={"Origin": origin})
            assert response.status_code == 403, (method, path, response.text)
            assert response.json()["error"]["code"] == "origin_not_allowed"
            assert "access-control-allow-origin" not in response.headers      # CORS stays off
        refused = c.post("/v1/knobs", json={"name": "max_num_seqs", "value": 1}, headers={"Origin": origin})
        assert refused.status_code == 403
    assert knobs(host)["paused"] is False and knobs(host)["knobs"]["max_num_seqs"] == host.max_num_seqs


def test_the_allowed_and_the_own_origin_pass(host):
    port = host.url.rsplit(":", 1)[1]
    with host.client() as c:
        for origin in (ALLOWED_ORIGIN, f"http://127.0.0.1:{port}"):
            assert c.post("/v1/resume", headers={"Origin": origin}).status_code == 200
        health = c.get("/health", headers={"Origin": "https://evil.example"})   # changes, reveals nothing
        assert health.status_code == 200


def test_the_key_guards_every_route(host):
    for key, status in ((None, 401), ("wrong", 401), (API_KEY, 200)):
        with host.client(key) as c:
            for path in ("/health", "/v1/knobs"):
                assert c.get(path).status_code == status, (key, path)
    with host.client(None) as c:
        assert c.post("/v1/pause").status_code == 401
    assert knobs(host)["paused"] is False


def test_a_body_over_the_limit_gets_413(host):
    with host.client() as c:
        response = c.post("/v1/knobs", content=b'{"name": "' + b"x" * MAX_BODY_BYTES + b'", "value": 1}',
                          headers={"Content-Type": "application/json"})
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert c.get("/v1/knobs").status_code == 200


def test_a_keyless_remote_bind_is_refused():
    from batchtop.telemetry.protocol.guard import AccessRules
    from batchtop.telemetry.protocol.runner import ServerThread
    with pytest.raises(ValueError, match="refusing to bind '0.0.0.0' without --api-key"):
        ServerThread(object(), "0.0.0.0", 0, api_key=AccessRules().api_key)


def test_failure_inside_vllm_is_visible_and_commands_are_refused(guest_host):
    """Last: it switches batchtop's part off for the rest of the session."""
    host = guest_host
    assert host.tell("fail").startswith("ok")
    host.add(1)                                     # the next step's observer raises
    deadline = time.monotonic() + 30
    with host.client() as c:
        while c.get("/health").status_code != 503:
            assert time.monotonic() < deadline, "the failure never showed in /health"
            time.sleep(0.05)
        health = c.get("/health").json()
        assert health["status"] == "batchtop off"
        assert "injected observer failure" in health["batchtop_failure"]
        assert "injected observer failure" in c.get("/v1/knobs").json()["batchtop_failure"]
        for path, body in (("/v1/knobs", {"name": "max_num_seqs", "value": 2}), ("/v1/pause", None),
                           ("/v1/step", None), ("/v1/resume", None)):
            refused = c.post(path, json=body)
            assert refused.status_code == 503, (path, refused.text)
            assert refused.json()["error"]["code"] == "batchtop_off"
            assert "injected observer failure" in refused.json()["error"]["message"]
    hello, _ = _read_events(host, {}, 0)
    assert "injected observer failure" in hello["batchtop_failure"]
    before = int(host.tell("steps").split()[1])
    time.sleep(0.5)
    assert int(host.tell("steps").split()[1]) > before          # vLLM's scheduling goes on
