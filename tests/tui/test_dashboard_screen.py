"""The dashboard is a Screen: another app pushes it over its own screen, Esc pops it back, and the
source it was handed stays open when the caller keeps it. In BatchtopApp it is the only screen."""
from __future__ import annotations

import pytest
from textual.app import App
from textual.screen import Screen

from batchtop.tui.app import BatchtopApp
from batchtop.tui.dashboard import DashboardScreen
from batchtop.tui.sources import FeedSource

pytestmark = pytest.mark.asyncio


class KeptSource(FeedSource):
    closed = False

    def close(self) -> None:
        self.closed = True


class ListApp(App):
    """Stands for the fleet screen: a screen of its own, the dashboard pushed over it."""


async def test_pushed_dashboard_pops_on_escape_and_leaves_the_source_open():
    source = KeptSource(knobs={"max_num_seqs": 4})
    app = ListApp()
    async with app.run_test(size=(120, 40)) as pilot:
        below = app.screen
        dashboard = DashboardScreen(source, tick_s=None, owns_source=False)
        await app.push_screen(dashboard)
        await pilot.pause()
        assert app.screen is dashboard and dashboard.query_one("#status")
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is below and not source.closed


async def test_the_only_dashboard_stays_on_escape():
    app = BatchtopApp(FeedSource(), tick_s=None)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen is app.dashboard and isinstance(app.screen, Screen)
