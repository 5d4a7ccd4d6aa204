"""An event travels from the engine to the fleet screen without waiting on any period: the server's pump
is woken by the engine's event buffer, the member's thread by its event stream, the screen by the
member. Every period on the way is set to 30 s here, so a link that still waited on one would hold
the event for 30 s."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx

from batchtop.telemetry.protocol import routes
from batchtop.tui.fleet import member as member_module
from batchtop.tui.fleet.member import Member
from batchtop.tui.fleet.screen import FleetApp
from batchtop.tui.fleet.targets import Target

PERIOD_S = 30.0
WITHIN_S = 5.0


def test_a_knob_change_reaches_the_screen_without_waiting_on_a_period(served, monkeypatch):
    server, thread = served
    monkeypatch.setattr(routes, "PUMP_INTERVAL_S", PERIOD_S)
    monkeypatch.setattr(member_module, "ROW_EVERY_S", PERIOD_S)
    old = server.engine.knobs()["max_num_seqs"]
    new = old - 1 if old > 1 else old + 1
    member = Member(Target("one", thread.url))
    drawn: list[tuple[float, int]] = []
    seen = threading.Event()

    def on_draw(rows, t: float) -> None:
        for row in rows:
            value = row.knobs.get("max_num_seqs")
            drawn.append((t, value))
            if value == new:
                seen.set()

    async def drive():
        app = FleetApp([member], tick_s=PERIOD_S, on_draw=on_draw)
        async with app.run_test(size=(160, 20)) as pilot:
            deadline = time.monotonic() + 60
            while member.rows[0].state != "live" or member.rows[0].knobs.get("max_num_seqs") != old:
                assert time.monotonic() < deadline, member.rows
                await pilot.pause(0.05)
            await pilot.pause(0.5)           # the pump is now in its (30 s) wait
            sent = time.monotonic()
            answer = httpx.post(thread.url + "/v1/knobs", json={"name": "max_num_seqs", "value": new})
            assert answer.is_success
            while not seen.is_set() and time.monotonic() < sent + WITHIN_S + 1:
                await pilot.pause(0.02)
            shown = next((t for t, value in drawn if value == new), None)
            assert shown is not None, f"not drawn within {WITHIN_S + 1} s: {drawn[-3:]}"
            assert shown - sent < WITHIN_S
    try:
        asyncio.run(drive())
    finally:
        member.close()
        httpx.post(thread.url + "/v1/knobs", json={"name": "max_num_seqs", "value": old})
