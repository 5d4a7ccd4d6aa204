"""Every error case: its status and an OpenAI-shaped body; none of them hurts the engine."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as client:
        yield client


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def post_raw(http, path, content: str):
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/knobs"])
def test_malformed_json_is_400(http, path):
    error = error_of(post_raw(http, path, '{"model": "tiny", "prompt": '), 400)
    assert "malformed JSON" in error["message"]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi"}, "model"),                                       # missing field
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, "n"),
    ({"model": "tiny", "prompt": {"text": "hi"}}, "prompt"),
    ([1, 2, 3], None),                                                 # not an object
])
def test_schema_violation_is_400_not_422(http, body, param):
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param


def test_chat_schema_violations(http):
    error_of(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400)
    error = error_of(http.post("/v1/chat/completions",
                               json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert error["param"] == "messages"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_unknown_model_is_404(http, path, body):
    error = error_of(http.post(path, json=body), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-4" in error["message"]


@pytest.mark.parametrize("value", [0, -5])
def test_max_tokens_below_one_is_400(http, value):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": value}
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["param"] == "max_tokens"


def test_context_overflow_is_400_naming_lengths(http):
    prompt = list(range(1000, 1100))                    # 100 tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 200}
    error = error_of(http.post("/v1/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded"
    for number in ("100", "200", "300", str(MAX_MODEL_LEN)):
        assert number in error["message"]


def test_chat_context_overflow(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 300}], "max_tokens": 5}
    error = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded"


def test_bad_token_ids_and_empty_prompt(http):
    error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": [10**9]}), 400)
    error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": []}), 400)
    error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400)


def test_too_many_stop_strings(http):
    error = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                        "stop": ["a", "b", "c", "d", "e"]}), 400)
    assert error["param"] == "stop"


@pytest.mark.parametrize("name, value, needle", [
    ("max_num_seqs", 0, "[1, "),
    ("max_num_seqs", 10**6, "[1, "),
    ("max_num_batched_tokens", "lots", "[1, 65536]"),
    ("batching_mode", "turbo", "continuous, static, dynamic"),
    ("dynamic_timeout_s", 100, "[0, 60]"),
    ("warp_speed", 9, "knobs: max_num_seqs"),
])
def test_invalid_knob_is_400_naming_the_range(http, name, value, needle):
    before = http.get("/v1/knobs").json()["knobs"]
    error = error_of(http.post("/v1/knobs", json={"name": name, "value": value}), 400)
    assert error["code"] == "invalid_knob"
    assert needle in error["message"]
    assert http.get("/v1/knobs").json()["knobs"] == before


def test_unknown_route_and_method(http):
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get("/v1/completions"), 405)


def test_abort_unknown_request_is_404(http):
    assert error_of(http.post("/v1/requests/nope/abort"), 404)["code"] == "request_not_found"


def test_step_while_running_is_409(http):
    assert error_of(http.post("/v1/step"), 409)["code"] == "not_paused"


def test_engine_still_serves_after_errors(http):
    out = http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 3})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
