"""DashboardScreen: the dashboard over any source (engine, replay, a feed of events, a server).

A Textual `Screen`, so any app can show it: `BatchtopApp` opens it as its only screen; another app
pushes it (`push_screen(DashboardScreen(source))`) and Esc pops it back. Once per tick (~10 Hz) the
screen polls its source and folds the new events into the view model; it redraws the visible panels
at most once per `refresh_s` (never one message per event), at once after a key, and once a second
when nothing moves. Keys map to `action_*` methods, the mixins of tui/dashboard_actions.py (see
BINDINGS and `?`). A source whose commands wait on the network (`commands_block`) is commanded from
a worker thread; its answer comes back as a `CommandAnswered` message, so no key waits on a slow or
unreachable server.
"""
from __future__ import annotations

import time
from typing import Callable

from textual import work
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Static

from .beside import BesideRun
from .dashboard_actions import ControlActions, KnobActions, ViewActions
from .keys import EVENT_ACTIONS, KEYS, SCRAPE_ACTIONS, action_ability, refusals
from .model import DashboardModel
from .plots import PLOT_WINDOWS_S, PLOTS, PlotPanel
from .scrape_panels import SCRAPE_VIEWS, MetricsPlot, ScrapedEngines, compose_scrape_panels
from .sources import LoadingSource, Source, SourceDescription
from .tables import EventLogView, RequestTable
from .widgets import HeaderBar, KvPanel, SlotGrid, TimelineView

VIEWS = ("requests", "plots", "events", "timeline")
WAITING = "sent to the {kind} source, waiting for its answer..."
NOT_ANSWERED = "the {kind} source has not answered the last command yet"
WIDE_COLUMNS = 130        # from here on the timeline sits beside the request table
IDLE_REDRAW_TICKS = 10     # with nothing new, redraw once a second (ages and rates move)


class CommandAnswered(Message):
    """A source command's answer (None, or the refusal), back from the worker thread that sent it."""

    def __init__(self, error: str | None, then: Callable[[str | None], None]):
        super().__init__()
        self.error = error
        self.then = then


class DashboardScreen(ControlActions, KnobActions, ViewActions, Screen):
    """One source's dashboard (its keys: tui/keys.py). `q` quits the app; Esc goes back when another
    screen lies below."""

    CSS_PATH = "dashboard.tcss"

    BINDINGS = KEYS + refusals(KEYS)

    def __init__(self, source: Source | None = None, *, source_factory: Callable[[], Source] | None = None,
                 loading_what: str = "engine", tick_s: float | None = 0.1,
                 clock: Callable[[], float] | None = None, plot_every: int = 10,
                 record_path: str | None = None, refresh_s: float = 0.0, message: str = "",
                 owns_source: bool = True, engine: str | None = None):
        """`engine`: over a scrape source serving several engines, the one shown first ("engine=1").
        The panels follow the source's description as the screen is composed: a source without
        per-step events (a /metrics scrape) gets the scrape panels."""
        super().__init__()
        self._owns_source = owns_source      # closed when the screen goes (False: the caller keeps it)
        self.source: Source = source or LoadingSource(loading_what)
        self.description: SourceDescription = self.source.describe()
        self.scraped = None if self.description.events else ScrapedEngines(self.source, engine)
        self.views = VIEWS if self.scraped is None else SCRAPE_VIEWS
        self._source_factory = source_factory
        self._tick_s = tick_s
        self._refresh_s = refresh_s
        self._last_redraw = float("-inf")
        self._clock = clock
        self._plot_every = plot_every
        self._record_path = record_path
        self.model = self._new_model()
        self.beside: BesideRun | None = None     # a recording replayed beside the source's: the plots draw it
        self.view = self.views[0]
        self.plot_window = PLOT_WINDOWS_S[1]
        self.status_message = message          # the status line's first words (a scenario's watch line)
        self._command_pending = False          # a command to a network source awaits its answer
        self._waiting_status: str | None = None   # the status line that says so, while it is shown
        self._seen_model_message = ""
        self._ticks = 0
        self._shown_status: str | None = None
        self._plots_dirty = True
        self._top_height = 0

    def _new_model(self) -> DashboardModel:
        return DashboardModel(knobs=dict(self.source.knobs), scenarios=self.description.scenarios)

    # -- keys from the source's description ----------------------------------------------------

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """A key whose ability the source lacks is hidden from the footer and answers why (`refuse`)."""
        if action == "refuse":
            return not self.description.can_do(parameters[0])
        if action == "view":
            return parameters[0] in self.views
        if action == "back":                     # only where the dashboard lies over another screen
            return self.app.screen_stack[0] is not self
        if action in EVENT_ACTIONS or action in SCRAPE_ACTIONS:
            return (action in SCRAPE_ACTIONS) == (self.scraped is not None)
        ability = action_ability(action, parameters)
        return ability is None or self.description.can_do(ability)

    def action_refuse(self, ability: str) -> None:
        self.say(self.description.why(ability), error=True)

    def _describe(self) -> None:
        """Read the source's description again; the footer follows when it changed (a server's hello)."""
        description = self.source.describe()
        if description != self.description:
            self.description = description
            self.refresh_bindings()

    # -- layout ----------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        if self.scraped is not None:
            yield from compose_scrape_panels()
            yield Static(id="status")
            yield Footer()
            return
        yield HeaderBar(id="header")
        with Horizontal(id="top"):
            yield SlotGrid(id="slots")
            yield KvPanel(id="kv")
        yield Static(id="viewbar")
        with ContentSwitcher(initial="requests", id="views"):
            with Horizontal(id="requests"):
                yield RequestTable(id="table")
                yield TimelineView(id="timeline-side")
            with Vertical(id="plots"):
                yield Static(id="plots-key")
                with Grid(id="plot-grid"):
                    for name in PLOTS:
                        yield PlotPanel(name, id=f"plot-{name}", classes="plot")
            yield EventLogView(id="events")
            yield TimelineView(id="timeline")
        yield Static(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.header = self.query_one("#header")
        self.slots = self.query_one("#slots")
        self.kv = self.query_one("#kv")
        self.switcher = self.query_one(ContentSwitcher)
        self.plot_panels = list(self.query(MetricsPlot if self.scraped else PlotPanel))
        if self.scraped is None:
            self.table = self.query_one(RequestTable)
            self.events = self.query_one(EventLogView)
            self.timelines = list(self.query(TimelineView))
        self._render_viewbar()
        if self._tick_s:
            self.set_interval(self._tick_s, self.tick)
        if self._source_factory is not None:
            self._load_source()
        else:
            self.attach_source(self.source)

    def on_resize(self, event) -> None:
        width, height = self.app.size
        self.set_class(width >= WIDE_COLUMNS, "wide")
        if self.scraped is None:
            self._fit_top()
        self._plots_dirty = True

    def _fit_top(self) -> None:
        """Give the slot grid the lines it needs, within a third of the screen (7 lines at least)."""
        width, height = self.app.size
        slots = self.query_one(SlotGrid)
        wanted = max(slots.wanted_height(slots.size.width or width - 38),
                     7 + min(8, self.model.num_running))      # the KV panel lists blocks per request
        top = min(max(7, wanted), max(7, (height - 7) // 3))
        if top != self._top_height:
            self._top_height = top
            self.query_one("#top").styles.height = top
            self.call_after_refresh(self.query_one(KvPanel).refresh)     # redraw at the new size

    @work(thread=True, exclusive=True)
    def _load_source(self) -> None:
        """Build the real source off the UI thread (a model load takes seconds)."""
        try:
            source = self._source_factory()
        except Exception as error:     # shown in the header; the app stays up to say so
            self.app.call_from_thread(self._source_failed, f"{type(error).__name__}: {error}")
            return
        self.app.call_from_thread(self.attach_source, source)

    def _source_failed(self, message: str) -> None:
        if isinstance(self.source, LoadingSource):
            self.source.error = message
        self.say(message, error=True)

    def attach_source(self, source: Source) -> None:
        """Switch to `source` (starting it when it has a start()) and start from an empty model."""
        if source is not self.source:
            self.source = source
            self._describe()
            self.model = self._new_model()
        self._attach_beside()
        start = getattr(source, "start", None)
        if start is not None:
            start()
        if self._record_path:
            self.say(source.start_recording(self._record_path) or f"recording to {self._record_path}")
        self.tick()

    def _attach_beside(self) -> None:
        self.beside = BesideRun(self.source) if self.source.beside is not None else None
        if self.scraped is None:
            self.set_class(self.beside is not None, "beside")
            self.query_one("#plots-key", Static).update(self.beside.key() if self.beside else "")

    def now(self) -> float | None:
        if self._clock is not None:
            return self._clock()
        return self.source.now() or self.model.last_t

    # -- the tick ------------------------------------------------------------------------------

    def tick(self) -> None:
        """Drain the source into the model and refresh what is visible: the UI's only heartbeat."""
        if not self.query("#status"):     # the widgets are not composed yet, or already torn down
            return
        self._describe()
        if self.scraped is not None:
            self._ticks += 1
            if self.scraped.update(self._ticks):
                self.refresh_views()
            return
        poll = self.source.poll()
        if poll.reset:
            self.model = self._new_model()
            self._plots_dirty = True
        if poll.events:
            self.model.feed(poll.events)
        now = self.now()
        if now is not None:
            self.model.advance(now)
        moved = poll.events or poll.reset
        if self.beside is not None and self.beside.update():
            moved = True
        self._ticks += 1
        self._fit_top()
        if self.model.message != self._seen_model_message:
            self._seen_model_message = self.status_message = self.model.message
        # Rendering is the UI thread's main cost and it holds the GIL the engine thread needs:
        # new events redraw at most once per refresh_s; a quiet tick redraws once a second
        # (for the ages and rates).
        if (moved and time.monotonic() - self._last_redraw >= self._refresh_s
                or self._ticks % IDLE_REDRAW_TICKS == 0):
            self.refresh_views()

    def refresh_views(self) -> None:
        self._last_redraw = time.monotonic()
        self.header.refresh()
        self.slots.refresh()
        self.kv.refresh()
        if self.scraped is not None:
            self._refresh_scrape_views()
        elif self.view == "requests":
            self.table.refresh()
            if self.has_class("wide"):
                self.timelines[0].refresh()
        elif self.view == "events":
            self.events.refresh()
        elif self.view == "timeline":
            self.timelines[1].refresh()
        elif self.view == "plots" and (self._plots_dirty or self._ticks % self._plot_every == 0):
            self.redraw_plots()
        if self.status_message != self._shown_status:
            self._shown_status = self.status_message
            self.query_one("#status", Static).update(self.status_message)

    def _refresh_scrape_views(self) -> None:
        if self.view == "plots":
            for panel in self.plot_panels:
                panel.redraw(self.scraped.shown(), self.plot_window)
        else:
            self.query_one(f"#{self.view}").refresh()

    def redraw_plots(self) -> None:
        beside = self.beside.plotted() if self.beside is not None else None
        for panel in self.plot_panels:
            panel.redraw(self.model, self.plot_window, beside)
        self._plots_dirty = False

    def say(self, message: str, error: bool = False) -> None:
        self.status_message = self._shown_status = f"[b red]{message}[/]" if error else message
        self.query_one("#status", Static).update(self.status_message)

    def _answer(self, error: str | None, ok: str = "") -> None:
        if error:
            self.say(error, error=True)
        elif ok:
            self.say(ok)
        self.refresh_views()

    def command(self, call: Callable[[], str | None], then: Callable[[str | None], None]) -> None:
        """Run a source command and hand its answer to `then`: at once for a local source; from a
        worker thread for one whose commands wait on the network, the answer posted back as a
        CommandAnswered message (the screen says the command is on its way meanwhile). One at a time:
        a command sent before the last one's answer is refused (a second pause would read the state
        the first has not changed yet)."""
        if not self.source.commands_block:
            then(call())
            return
        if self._command_pending:
            self.say(NOT_ANSWERED.format(kind=self.source.kind), error=True)
            self._waiting_status = self.status_message
            return
        self._command_pending = True
        self.say(WAITING.format(kind=self.source.kind))
        self._waiting_status = self.status_message

        def send() -> None:
            try:
                error = call()
            except Exception as failure:          # a source's bug is shown, never raised into the UI
                error = f"{type(failure).__name__}: {failure}"
            self.post_message(CommandAnswered(error, then))
        self.run_worker(send, thread=True, group="commands", exit_on_error=False)

    def on_command_answered(self, message: CommandAnswered) -> None:
        self._command_pending = False
        if self.status_message == self._waiting_status:
            self.say(f"the {self.source.kind} source answered")
        message.then(message.error)

    @property
    def selected_request(self) -> str | None:
        if self.table.selected is None:
            rows = self.table.sorted_requests()
            self.table.selected = rows[0].request_id if rows else None
        return self.table.selected

    def _render_viewbar(self) -> None:
        labels = []
        for i, name in enumerate(self.views, 1):
            labels.append(f"[reverse b] {i} {name} [/]" if name == self.view else f" {i} {name} ")
        extra = f"  window {self.plot_window:g}s (w)" if self.view == "plots" else ""
        self.query_one("#viewbar", Static).update("".join(labels) + extra)

    def on_unmount(self) -> None:
        if self._owns_source:
            self.source.close()

