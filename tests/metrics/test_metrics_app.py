"""The dashboard over a /metrics source (Pilot): the scrape panels, over expositions served by a plain
HTTP server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from expositions import sglang_exposition, two_engines, vllm_fixture

from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources.scrape import MetricsSource

sys.path.insert(0, str(Path(__file__).parents[1] / "tui"))
from tui_helpers import screen_text  # noqa: E402


async def show(app, pilot, *keys):
    for key in keys:
        await pilot.press(key)
    app.tick()
    await pilot.pause()
    return screen_text(app)


@pytest.mark.asyncio
async def test_vllm_view_panels_intervals_and_read_only_keys(text_server):
    routes = {"/metrics": (200, two_engines(vllm_fixture("busy")))}
    server = text_server(routes)
    source = MetricsSource(server.url, "vllm", period_s=3600)
    app = BatchtopApp(source, engine="engine=1", tick_s=None)
    async with app.run_test(size=(130, 40)) as pilot:
        source.scrape_once()
        routes["/metrics"] = (200, two_engines(vllm_fixture("drained")))
        source.scrape_once()
        text = await show(app, pilot)
        assert "smollm2 engine=1 (2/2, e: next)" in text                  # picked by --engine
        assert "run 0  wait 0 (capacity 0, deferred 0)" in text and "KV pool 0/6 blocks 0%" in text
        assert "slot grid (the batch row by row) needs batchtop's per-step events" in text
        assert "smollm2 engine=0" in text and "per-request table needs batchtop's per-step events" in text
        text = await show(app, pilot, "3")
        assert "retired 12 (length 12)" in text
        assert "admitted 10" in text
        assert "steps 186 (11.9 tok/step)" in text
        text = await show(app, pilot, "e")
        assert "smollm2 engine=0 (1/2, e: next)" in text
        footer = text.splitlines()[-1]                                   # the keys follow the source
        assert "e next engine" in footer and not any(key in footer for key in ("knob", "pause", "abort"))
        text = await show(app, pilot, "m")
        assert "knobs are read-only over /metrics" in text
        text = await show(app, pilot, "space")
        assert "cannot be paused or stepped from /metrics" in text
        routes["/metrics"] = (200, two_engines(vllm_fixture("busy")))      # the server restarted
        source.scrape_once()
        text = await show(app, pilot)
        assert "server restarted (counters went down)" in text and "server restarted 1x" in text
        text = await show(app, pilot, "2")
        assert "tok/s: out in" in text and "KV used %" in text


@pytest.mark.asyncio
async def test_sglang_view_shows_its_pool_in_tokens(text_server):
    server = text_server({"/metrics": (200, sglang_exposition())})
    source = MetricsSource(server.url, "sglang", period_s=3600)
    app = BatchtopApp(source, tick_s=None)
    async with app.run_test(size=(130, 40)) as pilot:
        source.scrape_once()
        text = await show(app, pilot)
    assert "qwen" in text and "run 3  wait 5" in text
    assert "KV pool 10000/40000 tokens 25%" in text and "server: 123 gen tok/s" in text


def test_interval_line_carries_the_latency_percentiles():
    from batchtop.telemetry.exposition import parse_exposition
    from batchtop.telemetry.intervals import derive
    from batchtop.tui.scrape_panels import interval_line
    engine = "smollm2 engine=0"
    busy, drained = parse_exposition(vllm_fixture("busy"),
                                     1.0), parse_exposition(vllm_fixture("drained"), 21.0)
    line = interval_line(derive(busy.engines[engine], drained.engines[engine], t=21.0, dt=20.0), t0=1.0).plain
    assert line.startswith("+    20.0s steps 186") and "retired 12 (length 12)" in line
    for label in ("TTFT p50", "ITL p50", "E2E p50"):
        assert label in line
