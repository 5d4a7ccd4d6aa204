"""The fleet screen over three engines at once: two `batchtop serve --model tiny` with different knobs
and the session's real vLLM with batchtop's class (its side endpoint behind an API key). Rows against
each engine's /metrics, a knob to one engine and to all (vLLM's limit respected, each knob read back
over GET /v1/knobs), a recording of the three that replays each with its engine's own set-up, Enter/Esc
on the vLLM row."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from textual.widgets import Input
from transformers import AutoConfig
from vllm_helpers import AUTH, EVENTS_API_KEY, model_dir

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.server.app import ServerThread, build_server
from batchtop.engine.whatif.recording import read_recording
from batchtop.telemetry import events as ev
from batchtop.telemetry.exposition import parse_exposition
from batchtop.telemetry.fleet_log import read_fleet_log
from batchtop.telemetry.weights import weight_macs
from batchtop.tui.dashboard import DashboardScreen
from batchtop.tui.fleet.member import Member
from batchtop.tui.fleet.screen import FleetApp
from batchtop.tui.fleet.targets import Target


@pytest.fixture(scope="module")
def serves():
    out = []
    loaded = None
    for seqs in (8, 2):
        config = EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=256, max_num_seqs=seqs)
        server = build_server(config, loaded=loaded)
        loaded = server.engine.loaded
        out.append((server, ServerThread(server).start()))
    yield [thread.url for _, thread in out]
    for server, thread in out:
        thread.stop()
        server.loop.stop()


def knobs(url, key=False):
    return httpx.get(url + "/v1/knobs", headers=AUTH if key else {}, timeout=10).json()["knobs"]


async def until(pilot, app, check, what, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app.fleet.tick()
        if check():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}: {[m.rows for m in app.members]}")


async def step(url):
    """One short completion on vLLM, so that it runs a step (and applies what is queued)."""
    async with httpx.AsyncClient(timeout=300) as client:
        answer = await client.post(url + "/v1/completions", json={"model": "smollm2", "prompt": "Hello",
                                                                  "max_tokens": 2})
    assert answer.status_code == 200, answer.text


async def complete(url):
    async with httpx.AsyncClient(timeout=60) as client:
        answer = await client.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello",
                                                                  "max_tokens": 4})
    assert answer.status_code == 200, answer.text


def retired_in(path: str) -> set[str]:
    """The engines of a fleet recording with a finished request in it so far."""
    _, engines = read_fleet_log(path)
    return {name for name, (_, events) in engines.items()
            if any(isinstance(e, ev.RequestRetired) for e in events)}


async def answer(pilot, app, key, text):
    await pilot.press(key)
    app.screen.query_one(Input).value = text
    await pilot.press("enter")


def test_fleet_over_two_serves_and_a_real_vllm(vllm_server, serves, tmp_path):
    launched, events_url = vllm_server
    members = [Member(Target("serve-8", serves[0])), Member(Target("serve-2", serves[1])),
               Member(Target("vllm", events_url), api_key=EVENTS_API_KEY)]
    vllm_limit = knobs(events_url, key=True)["max_num_seqs"]

    async def drive():
        app = FleetApp(members, tick_s=None)
        async with app.run_test(size=(200, 30)) as pilot:
            await until(pilot, app, lambda: all(m.rows[0].state == "live" for m in members), "live rows")
            kinds = {m.name: m.rows[0].kind for m in members}
            assert kinds == {"serve-8": "batchtop serve", "serve-2": "batchtop serve",
                             "vllm": "batchtop-in-vLLM"}
            await until(pilot, app, lambda: members[2].rows[0].running == 0, "vLLM idle")
            exposition = httpx.get(launched.url + "/metrics").text
            (scraped,) = parse_exposition(exposition, 0.0, "vllm").engines.values()
            vllm_row = members[2].rows[0]
            assert (vllm_row.running, vllm_row.waiting) == (scraped.running, scraped.waiting) == (0, 0)
            assert vllm_row.knobs["max_num_seqs"] == vllm_limit

            # above vLLM's start value: refused for vLLM (named in its row, never sent), set on both serves
            app.fleet.table.selected = "serve-8"
            await answer(pilot, app, "K", f"max_num_seqs={vllm_limit + 1}")
            await pilot.press("y")
            await until(pilot, app, lambda: knobs(serves[0])["max_num_seqs"] == vllm_limit + 1
                        == knobs(serves[1])["max_num_seqs"], "knob to all")
            assert "refused here" in members[2].rows[0].reason
            assert knobs(events_url, key=True)["max_num_seqs"] == vllm_limit
            # within it: all three
            await answer(pilot, app, "K", "max_num_seqs=1")
            await pilot.press("y")
            await until(pilot, app, lambda: "max_num_seqs=1: accepted" in members[2].rows[0].reason,
                        "vLLM's answer")
            await step(launched.url)        # vLLM applies a knob before its next step
            await until(pilot, app, lambda: [knobs(serves[0])["max_num_seqs"],
                                             knobs(serves[1])["max_num_seqs"],
                                             knobs(events_url, key=True)["max_num_seqs"]] == [1, 1, 1],
                        "knob to all three")
            # to the selected engine alone: vLLM back to its start value
            app.fleet.table.selected = "vllm"
            await answer(pilot, app, "k", f"max_num_seqs={vllm_limit}")
            back = f"max_num_seqs={vllm_limit}: accepted"
            await until(pilot, app, lambda: back in members[2].rows[0].reason, "vLLM's answer")
            await step(launched.url)
            await until(pilot, app, lambda: knobs(events_url, key=True)["max_num_seqs"] == vllm_limit,
                        "knob to one")
            assert knobs(serves[0])["max_num_seqs"] == 1

            # the fleet's recording of each engine replays with the engine's own set-up, none assumed
            path = str(tmp_path / "fleet.jsonl")
            assert app.fleet.start_recording(path).startswith("recording 3 engines")
            await asyncio.gather(step(launched.url), complete(serves[0]), complete(serves[1]))
            await until(pilot, app, lambda: retired_in(path) == {"serve-8", "serve-2", "vllm"},
                        "each engine's finished request in the recording")
            app.fleet.stop_recording()
            for name in ("serve-8", "serve-2", "vllm"):      # each part starts from its engine's state
                assert any(isinstance(e, ev.EngineSnapshot) and e.cause == "request"
                           for e in read_recording(path, name).events), name
            served = read_recording(path, "vllm")
            state = httpx.get(events_url + "/v1/knobs", headers=AUTH, timeout=10).json()
            assert served.setup.assumed == () and served.setup.vllm["version"] == "0.32"
            assert served.setup.vllm["num_blocks"] == state["num_kv_blocks"] + 1
            assert served.setup.vllm["block_size"] == state["block_size"]
            assert served.setup.vllm["max_model_len"] == state["max_model_len"]
            assert served.setup.weight_macs == weight_macs(AutoConfig.from_pretrained(model_dir()))
            tiny = read_recording(path, "serve-8")
            assert tiny.setup.assumed == () and tiny.setup.num_kv_blocks == 64
            assert tiny.setup.weight_macs == (73_728, 3_145_728)      # the tiny model's

            await pilot.press("enter")
            assert isinstance(app.screen, DashboardScreen) and app.screen.source.kind == "remote"
            await pilot.press("escape")
            assert app.screen is app.fleet
    try:
        asyncio.run(drive())
    finally:
        httpx.post(events_url + "/v1/knobs", json={"name": "max_num_seqs", "value": vllm_limit}, headers=AUTH)
