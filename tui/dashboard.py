"""DashboardScreen: the dashboard over any source (engine, replay, a feed of events, a server).

A Textual `Screen`, so any app can show it: `BatchtopApp` opens it as its only screen; another app
pushes it (`push_screen(DashboardScreen(source))`) and Esc pops it back. Once per tick (~10 Hz) the
screen polls its source and folds the new events into the
view model; it redraws the visible panels at most once per `refresh_s` (never one
message per event), at once after a key, and once a second when nothing moves.
Keys map to `action_*` methods (see BINDINGS and `?`). A source whose commands wait on the
network (`commands_block`) is commanded from a worker thread; its answer comes back as a
`CommandAnswered` message, so no key waits on a slow or unreachable server.
"""
from __future__ import annotations

import time
from typing import Callable

from textual import work
from textual.actions import parse
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, Static

from .keys import EVENT_ACTIONS, KEYS, SCRAPE_ACTIONS, action_ability, refusals
from .model import DashboardModel
from .plots import PLOT_WINDOWS_S, PLOTS, PlotPanel
from .scrape_panels import SCRAPE_VIEWS, MetricsPlot, ScrapedEngines, compose_scrape_panels
from .screens import ConfirmScreen, HelpScreen, PromptScreen, knob_assignment
from .sources import LoadingSource, Source, SourceDescription
from .tables import COLUMNS, EventLogView, RequestTable
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


class DashboardScreen(Screen):
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
            with Grid(id="plots"):
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
        start = getattr(source, "start", None)
        if start is not None:
            start()
        if self._record_path:
            self.say(source.start_recording(self._record_path) or f"recording to {self._record_path}")
        self.tick()

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
        self._ticks += 1
        self._fit_top()
        if self.model.message != self._seen_model_message:
            self._seen_model_message = self.status_message = self.model.message
        # Rendering is the UI thread's main cost and it holds the GIL the engine thread needs:
        # new events redraw at most once per refresh_s; a quiet tick redraws once a second
        # (for the ages and rates).
        moved = poll.events or poll.reset
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
        for panel in self.plot_panels:
            panel.redraw(self.model, self.plot_window)
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

    # -- actions: engine control ---------------------------------------------------------------

    def action_help(self) -> None:
        """The keys this source serves, then one line per thing it cannot do and why."""
        keys = [b for b in KEYS if self.check_action(*parse(b.action)[1:])]
        intro = f"source: {self.source.kind} · {self.source.status()}"
        self.app.push_screen(HelpScreen(keys, intro, self.description.refusals()))

    def action_toggle_pause(self) -> None:
        self.command(self.source.toggle_pause, self._answer)

    def action_step(self) -> None:
        self.command(self.source.step_once, self._answer)

    def action_step_back(self) -> None:
        self._answer(self.source.step_back())

    def action_speed(self, faster: bool) -> None:
        self._answer(self.source.change_speed(faster))

    def action_seek(self) -> None:
        def done(value: str | None) -> None:
            if not value:
                return
            try:
                step = int(value)
            except ValueError:
                self.say(f"not a step number: {value!r}", error=True)
                return
            self._answer(self.source.seek(step), f"seek to step {step}")
        self.app.push_screen(PromptScreen("seek to step:", placeholder="step number"), done)

    # -- actions: knobs -----------------------------------------------------------------------

    def set_knob(self, name: str, value) -> str | None:
        """Ask the source to change a knob; the refusal (a message) or None. Shown either way. A knob is
        named in full or by its label ("seqs"); only the source's own knobs are offered. Over a source
        whose commands wait on the network, None means sent: its answer is shown when it comes."""
        knob = self.description.knob(name)
        if knob is None:
            error = self.description.why(f"knob:{name}")
        else:
            answers: list[str | None] = []

            def answered(error: str | None) -> None:
                answers.append(error)
                self._knob_answered(knob, value, error)
            self.command(lambda: self.source.set_knob(knob.name, value), answered)
            return answers[0] if answers else None
        self.say(f"refused: {error}", error=True)
        return error

    def _knob_answered(self, knob, value, error: str | None) -> None:
        if error:
            self.say(f"refused: {error}", error=True)
            return
        if knob.applies != "next step":
            self.say(f"{knob.name} → {value} requested (applies at the {knob.applies})")
        else:
            self.model.knobs[knob.name] = _coerce(value)     # KnobChanged confirms it a tick later
            self.say(f"{knob.name} → {value}")
        self.refresh_views()

    def action_type_knob(self) -> None:
        def done(value: str | None) -> None:
            if not value:
                return
            assignment = knob_assignment(value, "max_num_seqs=32")
            if isinstance(assignment, str):
                self.say(assignment, error=True)
                return
            self.set_knob(*assignment)
        offered = self.description.knobs
        names = ", ".join(offered)
        labels = " ".join(k.label for k in offered.values())
        first = next(iter(offered.values()))
        self.app.push_screen(PromptScreen(f"knob=value  ({names}; short: {labels})",
                                      placeholder=f"{first.name}={self._suggestion(first)}"), done)

    def _suggestion(self, knob) -> object:
        """A value to show in the prompt: half the current one, never past the knob's limits."""
        if knob.choices:
            return knob.choices[0]
        current = self.model.knobs.get(knob.name)
        value = current // 2 if isinstance(current, int) and current > 1 else (current or knob.low)
        high = knob.upper()
        return value if high is None else min(value, int(high) if knob.type is int else high)

    def action_knob_step(self, name: str, up: bool) -> None:
        current = self.model.knobs.get(name)
        if not isinstance(current, (int, float)):
            self.say(f"{name} is not known here", error=True)
            return
        if name == "load_rate":
            new = round(current * 1.5 if current else 0.5, 2) if up else round(current / 1.5, 2)
        elif name == "long_prefill_token_threshold":
            new = (current * 2 if current else 16) if up else (current // 2 if current > 16 else 0)
        else:
            new = current * 2 if up else max(1, current // 2)
        knob = self.description.knobs.get(name)
        high = knob.upper() if knob is not None else None
        if up and high is not None and new > high:          # vLLM's knobs end at their start values
            if current >= high:
                self.say(f"{name} is at its limit of {_plain(high)} over this source", error=True)
                return
            new = int(high) if isinstance(current, int) else high
        self.set_knob(name, new)

    def action_next_scenario(self) -> None:
        names = list(self.description.scenarios)
        current = self.model.knobs.get("scenario")
        name = names[(names.index(current) + 1) % len(names)] if current in names else names[0]
        self.say(self.source.start_scenario(name))

    def action_cycle_knob(self, name: str) -> None:
        choices = self.description.knobs[name].choices
        current = self.model.knobs.get(name)
        new = choices[(choices.index(current) + 1) % len(choices)] if current in choices else choices[0]
        self.set_knob(name, new)

    # -- actions: requests ----------------------------------------------------------------------

    def action_abort(self) -> None:
        request_id = self.selected_request
        if request_id is None:
            self.say("no request selected", error=True)
            return
        def done(yes: bool | None) -> None:
            if yes:
                self.command(lambda: self.source.abort(request_id),
                             lambda error: self._answer(error, f"abort {request_id} sent"))
        self.app.push_screen(ConfirmScreen(f"Abort request {request_id}?"), done)

    def action_view(self, name: str) -> None:
        self.view = name
        self.switcher.current = name
        self._plots_dirty = True
        self._render_viewbar()
        self.refresh_views()
        if self.scraped is not None:
            self.call_after_refresh(self.refresh_views)       # plots need their size, known after the switch

    def action_next_engine(self) -> None:
        self.say(self.scraped.next_engine())
        self.refresh_views()

    def action_move(self, delta: int) -> None:
        if self.view == "events":
            if self.events.frozen is None:
                self.say("freeze the event log (v) to scroll it")
                return
            self.events.scroll_back = max(0, self.events.scroll_back - delta)
            self.events.refresh()
        else:
            self.table.move(delta)
            for timeline in self.timelines:
                timeline.refresh()

    def action_sort(self, reverse: bool) -> None:
        if reverse:
            self.table.sort_reverse = not self.table.sort_reverse
        else:
            self.table.sort_column = (self.table.sort_column + 1) % len(COLUMNS)
        self.say(f"sorted by {COLUMNS[self.table.sort_column].name}"
                 f"{' (reversed)' if self.table.sort_reverse else ''}")
        self.table.refresh()

    def action_toggle_finished(self) -> None:
        self.table.show_finished = not self.table.show_finished
        self.say("finished requests " + ("shown" if self.table.show_finished else "hidden"))
        self.table.refresh()

    # -- actions: event log, plots ---------------------------------------------------------------

    def action_filter_kinds(self) -> None:
        def done(value: str | None) -> None:
            if value is None:
                return
            kinds = tuple(k.strip().lower() for k in value.replace(" ", ",").split(",") if k.strip())
            self.events.kinds = () if kinds in ((), ("all",)) else kinds
            self.action_view("events")
        self.app.push_screen(PromptScreen("event kinds to show (comma-separated parts of names, e.g. "
                                      "preempt,retired,knob; empty: all)", ",".join(self.events.kinds)), done)

    def action_filter_request(self) -> None:
        def done(value: str | None) -> None:
            if value is None:
                return
            self.events.request_id = value or None
            self.action_view("events")
        self.app.push_screen(PromptScreen("request id to follow in the event log (empty: all)",
                                      self.selected_request or ""), done)

    def action_toggle_step_events(self) -> None:
        self.events.show_steps = not self.events.show_steps
        self.events.refresh()

    def action_freeze(self) -> None:
        if self.events.frozen is None:
            self.events.freeze(list(self.model.log))
            self.say("event log frozen (the engine runs on); v to follow again, ↑/↓ to scroll")
        else:
            self.events.freeze(None)
            self.say("event log follows the engine")
        self.events.refresh()

    def action_plot_window(self) -> None:
        i = PLOT_WINDOWS_S.index(self.plot_window) if self.plot_window in PLOT_WINDOWS_S else 0
        self.plot_window = PLOT_WINDOWS_S[(i + 1) % len(PLOT_WINDOWS_S)]
        self._plots_dirty = True
        self._render_viewbar()
        self.refresh_views()

    # -- actions: recording ----------------------------------------------------------------------

    def action_record(self) -> None:
        if self.source.recording:
            path = self.source.recording
            self._answer(self.source.stop_recording(), f"recording saved to {path}")
            return
        def done(path: str | None) -> None:
            if path:
                self._answer(self.source.start_recording(path), f"recording to {path}")
        default = time.strftime("batchtop-%Y%m%d-%H%M%S.jsonl")
        self.app.push_screen(PromptScreen("record events to (JSONL):", default), done)

    def action_back(self) -> None:
        self.app.pop_screen()

    def on_unmount(self) -> None:
        if self._owns_source:
            self.source.close()


def _coerce(value):
    """'32' → 32, '1.5' → 1.5, anything else unchanged (for the optimistic knob display)."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def _plain(x: float):
    return int(x) if float(x).is_integer() else x
