"""The fleet screen over two `batchtop serve` engines with different knobs (the real vLLM beside them:
tests/vllm/test_vllm_fleet.py): rows against each engine's /metrics and events, a knob to one engine
and to all (read back over GET /v1/knobs), an engine stopped and started again, a fleet recording."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, NUM_KV_BLOCKS, wait_idle
from textual.widgets import Input

from batchtop.engine.core.config import EngineConfig
from batchtop.engine.server.app import ServerThread, build_server
from batchtop.telemetry.exposition import parse_exposition
from batchtop.telemetry.fleet_log import read_fleet_log
from batchtop.tui.dashboard import DashboardScreen
from batchtop.tui.fleet.member import Member
from batchtop.tui.fleet.screen import FleetApp
from batchtop.tui.fleet.targets import Target


@pytest.fixture(scope="module")
def pair(served):
    """Two engines ("wide": max_num_seqs 16, "narrow": 4) on one loaded tiny model, each on its port."""
    loaded = served[0].engine.loaded
    out = {}
    for name, seqs in (("wide", 16), ("narrow", 4)):
        config = EngineConfig(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN,
                              max_num_seqs=seqs)
        server = build_server(config, loaded=loaded)
        out[name] = [server, ServerThread(server).start()]
    yield out
    for server, thread in out.values():
        thread.stop()
        server.loop.stop()


async def until(pilot, app, check, timeout_s: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app.fleet.tick()
        result = check()
        if result:
            return result
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what or check}: rows {[m.rows for m in app.members]}")


async def answer(pilot, app, key, text):
    """Press `key` and answer its prompt with `text` (typed into the prompt's input at once)."""
    await pilot.press(key)
    app.screen.query_one(Input).value = text
    await pilot.press("enter")


def row(app, name):
    return next(r for m in app.members for r in m.rows if r.name == name)


def knob(url, name):
    return httpx.get(url + "/v1/knobs").json()["knobs"][name]


def complete(url, n, max_tokens):
    def one():
        httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello there",
                                                  "max_tokens": max_tokens, "ignore_eos": True}, timeout=60)
    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    return threads


def test_fleet_over_two_serves(pair, tmp_path):
    wide, narrow = (pair[name][1].url for name in ("wide", "narrow"))
    members = [Member(Target("wide", wide)), Member(Target("narrow", narrow), backoff_s=(0.2, 0.5))]
    record = tmp_path / "fleet.jsonl"

    async def drive():
        app = FleetApp(members, tick_s=None)
        async with app.run_test(size=(200, 30)) as pilot:
            await until(pilot, app, lambda: all(r.state == "live" for m in members for r in m.rows),
                        what="live")
            assert {r.kind for m in members for r in m.rows} == {"batchtop serve"}
            assert row(app, "narrow").knobs["max_num_seqs"] == 4
            assert row(app, "wide").knobs["max_num_seqs"] == 16

            # rows against /metrics and the engines' own state, with the narrow engine's queue held
            assert app.fleet.start_recording(str(record)).startswith("recording 2 engines")
            threads = complete(narrow, 8, 48) + complete(wide, 2, 8)
            narrow_server = pair["narrow"][0]
            deadline = time.monotonic() + 20
            while len(narrow_server.engine.scheduler.waiting) < 4 and time.monotonic() < deadline:
                await pilot.pause(0.02)
            await until(pilot, app, lambda: row(app, "narrow").binds == "max_num_seqs 4", what="binds")
            assert httpx.post(narrow + "/v1/pause").status_code == 200
            await until(pilot, app, lambda: row(app, "narrow").state == "paused", what="paused")
            await pilot.pause(0.3)
            scraped = parse_exposition(httpx.get(narrow + "/metrics").text, 0.0, "vllm")
            (metrics,) = scraped.engines.values()
            shown = await until(pilot, app,
                                lambda: (r := row(app, "narrow")).running == metrics.running and r)
            assert (shown.running, shown.waiting) == (4, 4) == (metrics.running, metrics.waiting)
            assert shown.kv_pct == pytest.approx(100 * metrics.kv_usage, abs=0.01)
            assert shown.binds == "paused"
            assert shown.preemptions == metrics.counters["preemptions"]
            model = members[1].model          # the model its dashboard folds: the same numbers
            assert (model.num_running, model.num_waiting) == (4, 4)

            # Enter: the engine's full dashboard over the same source, folding the same events; Esc: back
            app.fleet.table.selected = "narrow"
            await pilot.press("enter")
            dashboard = app.screen
            assert isinstance(dashboard, DashboardScreen)
            await until(pilot, app, lambda: (dashboard.tick(), dashboard.model.num_running)[1] == 4,
                        what="the dashboard's model")
            assert dashboard.model.num_waiting == 4 and dashboard.source.paused
            await pilot.press("escape")
            assert app.screen is app.fleet
            assert httpx.post(narrow + "/v1/resume").status_code == 200

            # sorted and filtered
            await pilot.press("s", "S")                  # by kind, reversed
            assert app.fleet.table.sort_column == 1 and app.fleet.table.sort_reverse
            await answer(pilot, app, "slash", "narr")
            assert [r.name for r in app.fleet.table.shown(time.monotonic())] == ["narrow"]
            app.fleet.table.filter, app.fleet.table.sort_column = "", 0
            app.fleet.table.selected = "wide"

            # a knob to the selected engine, then to every engine (confirmed)
            await answer(pilot, app, "k", "seqs=3")             # a knob by its label
            await until(pilot, app, lambda: knob(wide, "max_num_seqs") == 3, what="knob to one")
            assert knob(narrow, "max_num_seqs") == 4
            await answer(pilot, app, "K", "seqs 6")
            await pilot.press("y")
            await until(pilot, app, lambda: knob(wide, "max_num_seqs") == 6 == knob(narrow, "max_num_seqs"),
                        what="knob to all")
            await until(pilot, app,
                        lambda: all("max_num_seqs=6: accepted" in m.rows[0].reason for m in members),
                        what="each engine's answer in its row")
            for thread in threads:
                thread.join(60)
            await pilot.pause(0.5)
            app.fleet.stop_recording()

            # the narrow engine stopped: down with the reason, then back without a restart of the fleet
            server, thread = pair["narrow"]
            port = thread.port
            thread.stop()
            down = await until(pilot, app, lambda: (r := row(app, "narrow")).state == "down" and r,
                               what="down")
            assert down.reason
            pair["narrow"][1] = ServerThread(server, port=port).start()
            await until(pilot, app, lambda: row(app, "narrow").state == "live", timeout_s=30, what="back")
            assert row(app, "wide").state == "live"
    try:
        asyncio.run(drive())
    finally:
        for name in ("wide", "narrow"):
            pair[name][0].loop.set_knob("max_num_seqs", 16 if name == "wide" else 4, "test")
            wait_idle(pair[name][0])

    header, engines = read_fleet_log(record)
    assert list(engines) == ["wide", "narrow"]
    assert header["engines"]["narrow"]["knobs"]["max_num_seqs"] == 4
    for name, (own, events) in engines.items():
        kinds = {type(e).__name__ for e in events}
        assert {"RequestArrived", "StepFinished", "KnobChanged"} <= kinds, name


def test_each_engine_of_a_urls_file_uses_its_own_key(served, tmp_path, monkeypatch):
    """A keyed engine named with `key=VAR` in the file is followed with that key; the others with
    --api-key (here a key the keyed engine refuses)."""
    from batchtop.tui.fleet.commands import probe
    from batchtop.tui.fleet.targets import targets
    config = EngineConfig(model="tiny", num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN)
    keyed = build_server(config, loaded=served[0].engine.loaded, api_key="east-key")
    thread = ServerThread(keyed).start()
    monkeypatch.setenv("EAST_KEY", "east-key")
    listing = tmp_path / "engines.txt"
    listing.write_text(f"{thread.url} east key=EAST_KEY\n{served[1].url} plain\n")
    members = []
    try:
        found = targets([], str(listing))
        assert probe(found, "wrong-key") == {"east": None, "plain": None}
        unkeyed = targets([thread.url])
        assert "401" in probe(unkeyed, "wrong-key")[unkeyed[0].name]
        members = [Member(target, target.key("wrong-key")).start() for target in found]
        deadline = time.monotonic() + 30
        while not all(m.rows[0].state == "live" for m in members):
            assert time.monotonic() < deadline, [m.rows for m in members]
            time.sleep(0.05)
        assert members[0].kind() == "batchtop serve"
    finally:
        for member in members:
            member.close()
        thread.stop()
        keyed.loop.stop()
