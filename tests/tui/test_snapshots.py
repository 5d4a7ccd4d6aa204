"""The dashboard over the replayed fixture log with a fixed clock: stable screens at 120x40 and 80x24.

Regenerate after an intended change: BATCHTOP_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/tui
"""
from __future__ import annotations

import pytest
from tui_helpers import FIXTURE_LOG, assert_snapshot, footer_drawn, screen_text

from batchtop.tui.app import BatchtopApp
from batchtop.tui.sources import ReplaySource

pytestmark = pytest.mark.asyncio

SIZES = [(120, 40), (80, 24)]


async def dashboard_at(pilot, app, step: int) -> None:
    app.source.seek(step)
    app.tick()
    await pilot.pause()
    await footer_drawn(pilot, app)


def make_app() -> BatchtopApp:
    source = ReplaySource.from_file(FIXTURE_LOG, clock=lambda: 0.0, paused=True)
    return BatchtopApp(source, tick_s=None)     # the test is the timer: app.tick()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_requests_view(size):
    app = make_app()
    async with app.run_test(size=size) as pilot:
        await dashboard_at(pilot, app, 40)
        assert_snapshot(f"requests_{size[0]}x{size[1]}", screen_text(app))


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_plots_view(size):
    app = make_app()
    async with app.run_test(size=size) as pilot:
        await dashboard_at(pilot, app, 99)
        await pilot.press("2")
        app.tick()
        await pilot.pause()
        assert_snapshot(f"plots_{size[0]}x{size[1]}", screen_text(app))


async def test_events_view_filtered_and_timeline():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await dashboard_at(pilot, app, 60)
        await pilot.press("f", *"preempt,knob", "enter")
        app.tick()
        await pilot.pause()
        text = screen_text(app)
        assert "RequestPreempted" in text and "KnobChanged" in text and "StepFinished" not in text
        assert_snapshot("events_120x40", text)
        await pilot.press("1", "down", "4")
        app.tick()
        await pilot.pause()
        assert_snapshot("timeline_120x40", screen_text(app))


async def test_replay_keys_step_back_and_seek():
    app = make_app()
    async with app.run_test(size=(120, 40)) as pilot:
        await dashboard_at(pilot, app, 20)
        await pilot.press("n")
        app.tick()
        assert app.model.finished_step == 21
        await pilot.press("comma")
        app.tick()
        assert app.model.finished_step == 20
        await pilot.press("g", *"75", "enter")
        app.tick()
        assert app.model.finished_step == 75
        await pilot.press("k")
        await pilot.pause()
        assert "read-only" in str(app.query_one("#status").render())
        await pilot.press("?")
        await pilot.pause()
        assert "help" in type(app.screen).__name__.lower()
        assert "seek to step" in screen_text(app)
