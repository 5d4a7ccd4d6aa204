"""The metrics dashboard over a real, stock vLLM (no batchtop scheduler class), started by the tests.

During a load the dashboard's running / waiting / KV figures are those of the very exposition
it scraped (read here with prometheus_client directly, not through batchtop's mapping); over
the run the derived retirements equal the completed requests and the derived generation tokens
the sum of the `usage` fields.
"""
from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources.scrape import MetricsSource, detect

sys.path.insert(0, str(Path(__file__).parents[1] / "tui"))
from tui_helpers import screen_text  # noqa: E402

NUM_REQUESTS, MAX_TOKENS = 8, 48        # long enough that a fast machine is caught with requests waiting
MAX_BUSY_CHECKS = 3       # screens compared while requests wait (drawing one costs the CPUs vLLM runs on)
ENGINE = "smollm2 engine=0"


def raw_values(text: str) -> dict[str, float]:
    """The gauges the dashboard shows, straight from the exposition."""
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:kv_cache_usage_perc"):
                values[sample.name] = sample.value
            elif sample.name == "vllm:cache_config_info":
                values["num_gpu_blocks"] = float(sample.labels["num_gpu_blocks"])
    return values


async def complete(client: httpx.AsyncClient, url: str, i: int) -> dict:
    response = await client.post(f"{url}/v1/completions", json={
        "model": "smollm2", "prompt": f"Request {i}: " + "tell me about continuous batching " * (30 + i % 5),
        "max_tokens": MAX_TOKENS, "temperature": 0})
    response.raise_for_status()
    return response.json()["usage"]


@pytest.mark.asyncio
async def test_dashboard_agrees_with_vllm_metrics_during_and_after_a_load(stock_vllm):
    _, url = stock_vllm
    assert detect(url) == "vllm"
    # A long period: the test scrapes by hand, so that it knows which exposition the screen shows.
    source = MetricsSource(url, "vllm", period_s=3600)
    app = BatchtopApp(source, tick_s=None)
    seen = []
    async with app.run_test(size=(140, 40)) as pilot:
        await asyncio.to_thread(source.scrape_once)
        async with httpx.AsyncClient(timeout=300) as client:
            load = asyncio.gather(*(complete(client, url, i) for i in range(NUM_REQUESTS)))
            task = asyncio.ensure_future(load)
            while not task.done():
                await asyncio.to_thread(source.scrape_once)
                raw = raw_values(source.last_text)
                busy = raw["vllm:num_requests_running"] > 0 and raw["vllm:num_requests_waiting"] > 0
                if not seen or busy and len(seen) <= MAX_BUSY_CHECKS:
                    app.tick()
                    await pilot.pause()
                    seen.append((raw, screen_text(app)))
                await asyncio.sleep(0.5)
            usages = await task
        await asyncio.to_thread(source.scrape_once)
        app.tick()
        await pilot.pause()
        seen.append((raw_values(source.last_text), screen_text(app)))

    num_busy = 0
    for raw, text in seen:
        running, waiting = raw["vllm:num_requests_running"], raw["vllm:num_requests_waiting"]
        used = round(raw["vllm:kv_cache_usage_perc"] * raw["num_gpu_blocks"])
        assert re.search(rf"run {running:.0f}  wait {waiting:.0f} ", text), text
        assert f"KV pool {used}/{raw['num_gpu_blocks']:.0f} blocks" in text, text
        num_busy += running > 0 and waiting > 0
    assert num_busy, "the load never made requests wait (the pool is meant to be small)"

    view = source.snapshot()[ENGINE]
    assert view.totals["retired"] == NUM_REQUESTS
    assert view.totals["generation_tokens"] == sum(u["completion_tokens"] for u in usages)
    assert view.totals["admitted"] == NUM_REQUESTS
    assert not view.num_resets
