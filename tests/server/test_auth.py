"""--api-key guards every endpoint; without a key only loopback may be bound."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers import API_KEY

from batchtop.engine.server.app import ServerThread
from batchtop.telemetry.protocol.guard import check_bind, is_loopback
from batchtop.tui.cli import main

ENDPOINTS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/knobs"),
             ("POST", "/v1/knobs"), ("POST", "/v1/pause"), ("POST", "/v1/resume"), ("POST", "/v1/step"),
             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/events"),
             ("POST", "/v1/requests/r1/abort"), ("GET", "/openapi.json"), ("GET", "/docs"),
             ("GET", "/nothing")]


@pytest.mark.parametrize("method, path", ENDPOINTS)
@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {API_KEY}", API_KEY])
def test_every_endpoint_needs_the_key(keyed, method, path, header):
    headers = {"Authorization": header} if header else {}
    response = httpx.request(method, keyed[1].url + path, headers=headers, timeout=10)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}


def test_the_key_opens_them(keyed):
    url, auth = keyed[1].url, {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(url + "/health", headers=auth).status_code == 200
    assert httpx.get(url + "/metrics", headers=auth).status_code == 200
    assert httpx.get(url + "/v1/knobs", headers=auth).status_code == 200
    with httpx.stream("GET", url + "/v1/events", headers=auth, timeout=10) as response:
        assert response.status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_refuses_non_loopback_without_key(host):
    with pytest.raises(ValueError, match="refusing to bind"):
        check_bind(host, None)
    check_bind(host, "some-key")           # a key lifts the rule


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_is_allowed(host):
    assert is_loopback(host)
    check_bind(host, None)


def test_server_thread_and_cli_refuse_too(served, capsys):
    with pytest.raises(ValueError, match="refusing to bind"):
        ServerThread(served[0], host="0.0.0.0")
    assert main(["serve", "--host", "0.0.0.0", "--model", "tiny"]) == 2     # before loading any model
    assert "refusing to bind" in capsys.readouterr().err
