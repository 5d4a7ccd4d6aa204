"""MetricsSource and `top --url` detection over real HTTP: plain servers serving expositions."""
from __future__ import annotations

import socket
import time

import pytest
from expositions import sglang_exposition, vllm_fixture

from batchtop.tui.cli import main
from batchtop.tui.sources.scrape import MetricsSource, detect

ENGINE = "smollm2 engine=0"


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_detects_vllm_and_sglang(text_server):
    assert detect(text_server({"/metrics": (200, vllm_fixture("busy"))}).url) == "vllm"
    assert detect(text_server({"/metrics": (200, sglang_exposition())}).url) == "sglang"
    # vLLM with --api-key guards /v1/* but not /metrics
    assert detect(text_server({"/v1/knobs": (401, "{}"),
                               "/metrics": (200, vllm_fixture("busy"))}).url) == "vllm"


@pytest.mark.parametrize("routes, says", [
    ({"/": (200, "<html>hello</html>")}, "HTTP 404"),
    ({"/v1/knobs": (401, "{}"), "/metrics": (401, "{}")}, "wants an API key"),
    ({"/metrics": (200, "# TYPE up gauge\nup 1\n")}, "without vllm: or sglang: series"),
    ({"/metrics": (200, "<html>not metrics</html>")}, "not Prometheus text"),
])
def test_top_at_neither_says_what_it_tried(text_server, capsys, routes, says):
    server = text_server(routes)
    assert main(["top", "--url", server.url]) == 2
    err = capsys.readouterr().err
    assert "is neither batchtop's event stream nor a vLLM or SGLang server" in err
    assert "GET /v1/knobs" in err and says in err and "Traceback" not in err


def test_top_at_nothing_says_nothing_answers(capsys):
    with socket.socket() as s:            # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["top", "--url", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert "nothing answers at" in err and "Traceback" not in err


def test_source_scrapes_derives_and_survives_a_restart(text_server):
    routes = {"/metrics": (200, vllm_fixture("busy"))}
    server = text_server(routes)
    source = MetricsSource(server.url, "vllm", period_s=0.05, backoff_s=(0.05, 0.2)).start()
    try:
        wait_until(lambda: source.num_scrapes >= 2)
        routes["/metrics"] = (200, vllm_fixture("drained"))
        wait_until(lambda: source.snapshot()[ENGINE].totals.get("retired") == 12)
        assert source.status().startswith("live")
        port = server.port
        server.stop()                                     # the server goes away
        wait_until(lambda: "disconnected" in source.status())
        assert "retrying in" in source.status() or "ConnectError" in source.status()
        text_server({"/metrics": (200, vllm_fixture("busy"))}, port=port)      # back, counters lower
        wait_until(lambda: source.snapshot()[ENGINE].num_resets == 1)
        view = source.snapshot()[ENGINE]
        assert source.status().startswith("live")
        assert all(i.generation_tokens >= 0 and i.retired >= 0 for i in view.intervals)
        assert view.totals["retired"] == 12 and view.totals["generation_tokens"] == 384 - 13 + 13
    finally:
        source.close()


def test_source_is_read_only_and_says_why(text_server):
    source = MetricsSource(text_server({"/metrics": (200, vllm_fixture("busy"))}).url, "vllm")
    try:
        for answer in (source.set_knob("max_num_seqs", 4), source.toggle_pause(), source.abort("x")):
            assert "--scheduler-cls batchtop.engine.vllm.scheduler.BatchtopScheduler" in answer
    finally:
        source.close()
