"""Shared helpers for the dashboard tests: the fixture log, screen text, snapshot comparison."""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

from rich.console import Console

HERE = Path(__file__).parent
FIXTURE_LOG = HERE / "fixtures" / "small.jsonl"
SNAPSHOTS = HERE / "snapshots"
UPDATE_ENV = "BATCHTOP_UPDATE_SNAPSHOTS"


def screen_text(app) -> str:
    """The current screen as plain text, one line per row (what export_screenshot draws, minus styles)."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system="truecolor", legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines())


async def footer_drawn(pilot, app, timeout_s: float = 5.0) -> None:
    """Wait until the screen's footer has its keys: Textual fills it after a refresh, so one pause may not."""
    from textual.widgets import Footer
    deadline = time.monotonic() + timeout_s
    while not app.screen.query_one(Footer).children:
        if time.monotonic() > deadline:
            raise AssertionError(f"the footer had no keys after {timeout_s} s")
        await pilot.pause(0.01)
    await pilot.pause()


async def screen_when(pilot, app, shown, timeout_s: float = 5.0) -> str:
    """The screen's text once `shown(text)` holds, or as it is after `timeout_s`: a resize redraws a
    panel only after the next refresh, which a loaded machine may not reach within one pause."""
    deadline = time.monotonic() + timeout_s
    text = screen_text(app)
    while not shown(text) and time.monotonic() < deadline:
        await pilot.pause(0.05)
        app.screen.refresh_views()
        text = screen_text(app)
    return text


def assert_snapshot(name: str, text: str) -> None:
    """Compare with tests/tui/snapshots/NAME.txt; BATCHTOP_UPDATE_SNAPSHOTS=1 rewrites it."""
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get(UPDATE_ENV) or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
        if not os.environ.get(UPDATE_ENV):
            raise AssertionError(f"snapshot {path.name} did not exist: written, check it and rerun")
        return
    expected = path.read_text(encoding="utf-8").rstrip("\n")
    assert text == expected, (f"screen differs from {path} (rerun with {UPDATE_ENV}=1 if the change is "
                              f"intended)\n--- got ---\n{text}\n--- expected ---\n{expected}")
