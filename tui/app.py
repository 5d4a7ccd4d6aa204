"""BatchtopApp: the `batchtop` app, one DashboardScreen over one source.

The screen holds the widgets, keys and actions (tui/dashboard.py); this app only opens it as its
first screen, with the arguments it was given. `model`, `source` and `tick` read through to it, as
the tests drive the dashboard through the app.
"""
from __future__ import annotations

from textual.app import App
from textual.screen import Screen

from .dashboard import DashboardScreen
from .model import DashboardModel
from .sources import Source


class BatchtopApp(App):
    TITLE = "batchtop"
    CSS_PATH = DashboardScreen.CSS_PATH      # Textual reads a screen's CSS on push, not for the first screen

    def __init__(self, source: Source | None = None, **options):
        """`options` are DashboardScreen's (source_factory, tick_s, clock, record_path, ...)."""
        super().__init__()
        self.dashboard = DashboardScreen(source, **options)

    def get_default_screen(self) -> Screen:
        return self.dashboard

    @property
    def model(self) -> DashboardModel:
        return self.dashboard.model

    @property
    def source(self) -> Source:
        return self.dashboard.source

    def tick(self) -> None:
        self.dashboard.tick()
