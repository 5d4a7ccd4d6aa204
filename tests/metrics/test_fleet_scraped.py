"""The fleet screen over stock servers read through /metrics: a data-parallel vLLM's two engines as two
rows, an SGLang beside it, kinds and numbers from the scrape, "—" where events are needed, Enter opens
the scrape dashboard and Esc comes back."""
from __future__ import annotations

import asyncio
import time

from expositions import sglang_exposition, two_engines, vllm_fixture

from batchtop.tui.dashboard import DashboardScreen
from batchtop.tui.fleet.member import Member
from batchtop.tui.fleet.screen import FleetApp
from batchtop.tui.fleet.targets import Target


def test_fleet_over_scraped_servers(text_server):
    vllm = text_server({"/metrics": (200, two_engines(vllm_fixture("busy")))})
    sglang = text_server({"/metrics": (200, sglang_exposition(running=3, queued=5))})
    members = [Member(Target("dp", vllm.url), period_s=0.1), Member(Target("sg", sglang.url), period_s=0.1)]

    async def drive():
        app = FleetApp(members, tick_s=None)
        async with app.run_test(size=(200, 30)) as pilot:
            deadline = time.monotonic() + 20
            while not (len(members[0].rows) == 2 and members[1].rows[0].state == "live"
                       and all(r.tok_s is not None for m in members for r in m.rows)):
                assert time.monotonic() < deadline, [m.rows for m in members]
                await pilot.pause(0.05)
            app.fleet.tick()
            rows = {r.name: r for m in members for r in m.rows}
            assert set(rows) == {"dp smollm2 engine=0", "dp smollm2 engine=1", "sg"}
            assert {r.kind for r in rows.values()} == {"vLLM", "SGLang"}
            assert {r.mode for r in rows.values()} == {"scraped"}
            assert {r.binds for r in rows.values()} == {"—"}
            assert (rows["sg"].running, rows["sg"].waiting) == (3, 5)
            assert rows["dp smollm2 engine=0"].running == 2
            app.fleet.table.selected = "sg"
            await pilot.press("enter")
            assert isinstance(app.screen, DashboardScreen) and app.screen.source.kind == "metrics"
            await pilot.press("escape")
            assert app.screen is app.fleet
    asyncio.run(drive())
