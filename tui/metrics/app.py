"""MetricsApp: the dashboard over a stock vLLM or SGLang, read through `/metrics`.

The same screen as BatchtopApp (header, KV gauge and history, plots, a log) with what a
scrape can give: the source is a `MetricsSource` (started by the caller), each tick copies
its engines when a scrape came in, and the panels that need per-step events (slot grid,
request table) say what would fill them.
Knob, pause and abort keys answer why they cannot act here.
"""
from __future__ import annotations

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal
from textual.widgets import ContentSwitcher, Footer, Static

from batchtop.tui.plots import PLOT_WINDOWS_S
from batchtop.tui.screens import HelpScreen
from batchtop.tui.sources.metrics import NO_PAUSE_WHY, READ_ONLY_WHY, EngineView, MetricsSource

from .widgets import (
    METRIC_PLOTS,
    EnginesTable,
    IntervalLog,
    MetricsHeader,
    MetricsKvPanel,
    MetricsPlot,
    NeedsEventsPanel,
)

VIEWS = ("engines", "plots", "intervals")
IDLE_REDRAW_TICKS = 10


class MetricsApp(App):
    CSS_PATH = ["../dashboard.tcss", "metrics.tcss"]
    TITLE = "batchtop"

    BINDINGS = [
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("1", "view('engines')", "engines view", show=False),
        Binding("2", "view('plots')", "plots view", show=False),
        Binding("3", "view('intervals')", "interval log", show=False),
        Binding("e", "next_engine", "next engine"),
        Binding("w", "plot_window", "plots: next time window", show=False),
        Binding("k,m,M,t,T,c,C,b", "read_only", "knobs (read-only here)", key_display="k m t c b"),
        Binding("space,n", "no_pause", "pause / step (not here)", key_display="␣ n"),
        Binding("a", "read_only", "abort (not over /metrics: says why)", show=False),
        Binding("q", "quit", "quit"),
    ]

    def __init__(self, source: MetricsSource, *, engine: str | None = None, tick_s: float | None = 0.1):
        super().__init__()
        self.source = source
        self.engine = engine                 # the engine the header, KV panel, plots and log show
        self._tick_s = tick_s
        self.engines: dict[str, EngineView] = {}
        self.view = "engines"
        self.plot_window = PLOT_WINDOWS_S[1]
        self.status_message = ""
        self._seen_version = -1
        self._ticks = 0

    def compose(self) -> ComposeResult:
        yield MetricsHeader(id="header")
        with Horizontal(id="top"):
            yield NeedsEventsPanel("The slot grid (the batch row by row)", id="slots")
            yield MetricsKvPanel(id="kv")
        yield Static(id="viewbar")
        with ContentSwitcher(initial="engines", id="views"):
            yield EnginesTable(id="engines")
            with Grid(id="plots"):
                for name in METRIC_PLOTS:
                    yield MetricsPlot(name, id=f"plot-{name}", classes="plot")
            yield IntervalLog(id="intervals")
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.switcher = self.query_one(ContentSwitcher)
        self.plot_panels = list(self.query(MetricsPlot))
        self._render_viewbar()
        if self._tick_s:
            self.set_interval(self._tick_s, self.tick)
        self.tick()

    def tick(self) -> None:
        """Copy the source's engines when a scrape came in; redraw then, and once a second."""
        if not self.query("#status"):
            return
        self._ticks += 1
        version = self.source.version
        if version != self._seen_version or self._ticks % IDLE_REDRAW_TICKS == 0:
            self._seen_version = version
            self.engines = self.source.snapshot()
            if self.engine not in self.engines and self.engines:
                self.engine = self._match(self.engine)
            self.refresh_views()

    def _match(self, wanted: str | None) -> str:
        """The engine named `wanted` (its whole key, or a key part such as "engine=1"), else the first."""
        for key in self.engines:
            if wanted and (wanted == key or wanted in key.split(" ")):
                return key
        return next(iter(self.engines))

    def refresh_views(self) -> None:
        for widget in self.query("#header, #kv, #slots").results():
            widget.refresh()
        if self.view == "plots":
            view = self.engines.get(self.engine)
            for panel in self.plot_panels:
                panel.redraw(view, self.plot_window)
        else:
            self.query_one(f"#{self.view}").refresh()
        self.query_one("#status", Static).update(self.status_message)

    def say(self, message: str, error: bool = False) -> None:
        self.status_message = f"[b red]{message}[/]" if error else message
        self.query_one("#status", Static).update(self.status_message)

    def _render_viewbar(self) -> None:
        labels = [f"[reverse b] {i} {name} [/]" if name == self.view else f" {i} {name} "
                  for i, name in enumerate(VIEWS, 1)]
        extra = f"  window {self.plot_window:g}s (w)" if self.view == "plots" else ""
        self.query_one("#viewbar", Static).update("".join(labels) + extra)

    # -- actions -----------------------------------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.BINDINGS,
                                    f"source: {self.source.flavour} /metrics at {self.source.url}, "
                                                   f"scraped every {self.source.period_s:g} s. "
                                                   f"{READ_ONLY_WHY}."))

    def action_view(self, name: str) -> None:
        self.view = name
        self.switcher.current = name
        self._render_viewbar()
        self.refresh_views()
        self.call_after_refresh(self.refresh_views)       # plots need their size, known after the switch

    def action_next_engine(self) -> None:
        keys = list(self.engines)
        if len(keys) < 2:
            self.say("one engine behind this server")
            return
        self.engine = keys[(keys.index(self.engine) + 1) % len(keys)] if self.engine in keys else keys[0]
        self.say(f"showing {self.engine}")
        self.refresh_views()

    def action_plot_window(self) -> None:
        i = PLOT_WINDOWS_S.index(self.plot_window) if self.plot_window in PLOT_WINDOWS_S else 0
        self.plot_window = PLOT_WINDOWS_S[(i + 1) % len(PLOT_WINDOWS_S)]
        self._render_viewbar()
        self.refresh_views()

    def action_read_only(self) -> None:
        self.say(READ_ONLY_WHY, error=True)

    def action_no_pause(self) -> None:
        self.say(NO_PAUSE_WHY, error=True)

    def on_unmount(self) -> None:
        self.source.close()

