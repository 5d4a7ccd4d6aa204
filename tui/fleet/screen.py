"""`FleetScreen`: the fleet table, its keys, and the commands that go to one engine or to all.

Each engine is a `Member` that follows it on its own thread; a member whose rows changed tells the
screen (a `RowsChanged` message, one in flight at a time), which reads the published rows and redraws
at once, at most 20 times a second (and once a second otherwise: ages move). Commands to an
engine wait on the network, so they run on worker threads; each answer comes back as a
`FleetAnswered` message and is shown in that engine's row. Enter opens the selected engine's full
dashboard over the same source (Esc comes back); the members keep following their engines meanwhile.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static

from batchtop.telemetry.fleet_log import FleetRecorder

from ..screens import ConfirmScreen, HelpScreen, PromptScreen, knob_assignment
from .member import Member
from .pace import pace_status
from .rows import FleetRow
from .table import COLUMNS, FleetTable

TICK_S = 1.0                  # with nothing new, redraw once a second (ages move)
DRAW_GAP_S = 0.05             # a changed row is drawn at once, at most 20 times a second


class RowsChanged(Message):
    """A member published new rows (posted from its poll thread)."""


class FleetAnswered(Message):
    """An engine's answer to a command, back from the worker thread that sent it."""

    def __init__(self, member: Member, what: str, error: str | None):
        super().__init__()
        self.member, self.what, self.error = member, what, error


class FleetScreen(Screen):
    CSS_PATH = "fleet.tcss"

    BINDINGS = [
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("up", "move(-1)", "select up", show=False),
        Binding("down", "move(1)", "select down", show=False),
        Binding("enter", "open", "dashboard", key_display="⏎"),
        Binding("s", "sort(False)", "sort: next column"),
        Binding("S", "sort(True)", "sort: reverse"),
        Binding("slash", "filter", "filter", key_display="/"),
        Binding("k", "knob(False)", "knob: selected"),
        Binding("K", "knob(True)", "knob: all"),
        Binding("space", "pause", "pause selected"),
        Binding("r", "record", "rec"),
        Binding("q", "app.quit", "quit"),
    ]

    def __init__(self, members: list[Member], *, tick_s: float | None = TICK_S,
                 on_draw: Callable[[list[FleetRow], float], None] | None = None):
        super().__init__()
        self.members = members
        self._tick_s = tick_s
        self._on_draw = on_draw
        self._versions: tuple[int, ...] = ()
        self._change_posted = False                  # a RowsChanged is on its way
        self._draw_due = False                       # a draw is set for the end of the gap
        self._drawn_at = float("-inf")
        self.message = ""
        self.pace = ""
        self.recorder: FleetRecorder | None = None
        self._recorded: list[Member] = []
        self._recorded_as: dict[str, str] = {}       # member -> its name in the recording

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-title")
        yield FleetTable(id="fleet", on_draw=self._on_draw)
        yield Static(id="fleet-status")
        yield Footer()

    def on_mount(self) -> None:
        self.table = self.query_one(FleetTable)
        if self._tick_s:
            self.set_interval(self._tick_s, lambda: self.tick(force=True))
            for member in self.members:
                member.on_rows = self._rows_changed
        self.tick(force=True)

    def member(self, name: str) -> Member | None:
        for member in self.members:
            if name == member.name or name.startswith(member.name + " "):
                return member
        return None

    # -- the tick ---------------------------------------------------------------------------------

    def _rows_changed(self) -> None:
        """A member's poll thread: never blocks; one message in flight however many engines changed."""
        if not self._change_posted:
            self._change_posted = True
            self.post_message(RowsChanged())

    def on_rows_changed(self, message: RowsChanged) -> None:
        self._change_posted = False
        if self._draw_due:
            return
        wait = self._drawn_at + DRAW_GAP_S - time.monotonic()
        if wait <= 0:
            self.tick()
        else:
            self._draw_due = True
            self.set_timer(wait, self._draw_at_gap_end)

    def _draw_at_gap_end(self) -> None:
        self._draw_due = False
        self.tick()

    def tick(self, force: bool = False) -> None:
        """Read the members' rows and redraw if one changed (or `force`)."""
        if not self.is_current:
            return                             # the dashboard is on top: it draws, the members still poll
        versions = tuple(member.version for member in self.members)
        if versions != self._versions or force:
            self._versions = versions
            self._drawn_at = time.monotonic()
            self.table.rows = [row for member in self.members for row in member.rows]
            self._check_pace()
            self.redraw()

    def _check_pace(self) -> None:
        members = [m for m in self.members if m.target.rank is not None]
        ranks = {m.name: m.steps for m in members}
        if len(ranks) > 1:
            said = {m.source.meta.get("lock_step") for m in members if m.source is not None} - {None}
            status = pace_status(ranks, lock_step=False if False in said else True if said else None)
            if status is not None:
                self.pace = status

    def redraw(self) -> None:
        self.table.refresh()
        rows = self.table.rows
        states = {}
        for row in rows:
            states[row.state] = states.get(row.state, 0) + 1
        counts = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
        sort = COLUMNS[self.table.sort_column].name + (" reversed" if self.table.sort_reverse else "")
        title = f" batchtop fleet · {len(rows)} engines: {counts} · sorted by {sort}"
        if self.table.filter:
            title += f" · filter {self.table.filter!r}"
        if self.recorder is not None:
            title += f" · [b red]recording[/] {self.recorder.path}"
        self.query_one("#fleet-title", Static).update(title)
        selected = self.table.selected_row(time.monotonic())
        lines = [self.message] if self.message else []
        if self.pace:
            lines.append(f"[b]pace:[/] {self.pace}")
        if selected is not None:
            lines.append(f"{selected.name}: {selected.url} · {selected.kind} · {selected.state}"
                         + (f" · {selected.reason}" if selected.reason else ""))
        self.query_one("#fleet-status", Static).update("\n".join(lines[-3:]))

    def say(self, message: str, error: bool = False) -> None:
        self.message = f"[b red]{message}[/]" if error else message
        self.redraw()

    # -- keys ----------------------------------------------------------------------------------------

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen(self.BINDINGS, "the fleet: one row per engine; "
                                        "Enter opens its full dashboard, Esc there comes back"))

    def action_move(self, delta: int) -> None:
        self.table.move(delta)
        self.redraw()

    def action_sort(self, reverse: bool) -> None:
        if reverse:
            self.table.sort_reverse = not self.table.sort_reverse
        else:
            self.table.sort_column = (self.table.sort_column + 1) % len(COLUMNS)
        self.redraw()

    def action_filter(self) -> None:
        def done(value: str | None) -> None:
            if value is not None:
                self.table.filter = value
                self.redraw()
        self.app.push_screen(PromptScreen("show engines whose row contains (empty: all)", self.table.filter),
                             done)

    def _selected_member(self) -> Member | None:
        row = self.table.selected_row(time.monotonic())
        member = self.member(row.name) if row is not None else None
        if member is None:
            self.say("no engine selected", error=True)
        return member

    def action_open(self) -> None:
        member = self._selected_member()
        if member is None:
            return
        if member.source is None:
            self.say(f"{member.name} is not connected yet: {member.rows[0].reason}", error=True)
            return
        from ..dashboard import DashboardScreen
        from .shared import SharedSource
        self.app.push_screen(DashboardScreen(SharedSource(member)))

    def action_pause(self) -> None:
        member = self._selected_member()
        if member is not None:
            self._send(member, "pause" if not getattr(member.source, "paused", False) else "resume",
                       lambda source: source.toggle_pause())

    # -- commands to engines ------------------------------------------------------------------------

    def _send(self, member: Member, what: str, call) -> None:
        """Run `call(source)` on a worker thread; its answer comes back as a FleetAnswered message."""
        source = member.source
        if source is None:
            self.say(f"{member.name} is not connected: {what} not sent", error=True)
            return
        member.say(f"{what}: sent")

        def send() -> None:
            try:
                error = call(source)
            except Exception as failure:          # a source's bug is shown, never raised into the UI
                error = f"{type(failure).__name__}: {failure}"
            self.post_message(FleetAnswered(member, what, error))
        self.run_worker(send, thread=True, group=f"commands-{member.name}", exit_on_error=False)

    def on_fleet_answered(self, message: FleetAnswered) -> None:
        answer = f"{message.what}: refused: {message.error}" if message.error else f"{message.what}: accepted"
        message.member.say(answer)
        self.say(f"{message.member.name}: {answer}", error=bool(message.error))

    def action_knob(self, to_all: bool) -> None:
        target = "every engine that has it" if to_all else "the selected engine"

        def done(value: str | None) -> None:
            if not value:
                return
            assignment = knob_assignment(value, "max_num_seqs=8")
            if isinstance(assignment, str):
                self.say(assignment, error=True)
                return
            if to_all:
                self._knob_to_all(*assignment)
            else:
                member = self._selected_member()
                if member is not None:
                    self.set_knob([member], *assignment)
        self.app.push_screen(PromptScreen(f"knob=value for {target} (max_num_seqs, max_num_batched_tokens, "
                                          "long_prefill_token_threshold, ...)", placeholder="max_num_seqs=8"),
                             done)

    def _knob_to_all(self, name: str, value: str) -> None:
        members = [m for m in self.members if _knob(m, name) is not None]
        if not members:
            self.say(f"no engine offers the knob {name!r}", error=True)
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.set_knob(members, name, value)
        self.app.push_screen(ConfirmScreen(f"Set {name}={value} on {len(members)} engines "
                                           f"({', '.join(m.name for m in members)})?"), confirmed)

    def set_knob(self, members: list[Member], name: str, value) -> None:
        """Send name=value to each member that offers the knob and allows the value (a vLLM knob ends at
        vLLM's start value: refused here, named in the row, never sent); each answer in its row."""
        sent = []
        for member in members:
            knob = _knob(member, name)
            if knob is None:
                member.say(f"{name}: not a knob of this engine")
                continue
            try:
                parsed = knob.parse(value)
            except ValueError as error:
                member.say(f"{name}={value}: refused here: {error}")
                continue
            sent.append(member.name)
            self._send(member, f"{knob.name}={parsed}",
                       lambda source, knob=knob, parsed=parsed: source.set_knob(knob.name, parsed))
        self.say(f"{name}={value} sent to {', '.join(sent)}" if sent else f"{name}={value} sent to no engine",
                 error=not sent)

    # -- recording -------------------------------------------------------------------------------------

    def action_record(self) -> None:
        if self.recorder is not None:
            self.say(self.stop_recording())
            return

        def done(path: str | None) -> None:
            if path:
                self.say(self.start_recording(path))
        default = time.strftime("batchtop-fleet-%Y%m%d-%H%M%S.jsonl")
        self.app.push_screen(PromptScreen("record every event engine to one log (JSONL):", default), done)

    def start_recording(self, path: str) -> str:
        """Record every event engine from now on, each event named by its engine; an engine whose
        event stream starts later (down or not yet found now, or back from down) is recorded from when
        it joins. What happened, in words."""
        streaming = [m for m in self.members if m.flavour == "events" and m.source is not None]
        scraped = {m.name: m.url for m in self.members if m.flavour not in (None, "events")}
        waiting = {m.name: m.url for m in self.members if m not in streaming and m.name not in scraped}
        if not streaming and not waiting:
            return "no event engine to record (scraped engines have no events)"
        try:
            self.recorder = FleetRecorder(path, {m.name: _engine_header(m) for m in streaming},
                                          waiting=waiting, scraped=scraped)
        except OSError as error:
            return f"cannot record to {path}: {error.strerror}"
        self._recorded = [m for m in self.members if m.name not in scraped]
        self._recorded_as = {m.name: m.name for m in streaming}
        for member in self._recorded:
            member.tap(self._record)
        for member in streaming:     # each part begins from its engine's state: a what-if replays from it
            threading.Thread(target=member.source.request_snapshot, daemon=True,
                             name=f"snapshot-{member.name}").start()
        words = [f"recording {len(streaming)} engines to {path}"]
        if waiting:
            words.append(f"{len(waiting)} more from when they stream")
        if scraped:
            words.append(f"{len(scraped)} without an event stream are not recorded")
        return words[0] + (f" ({'; '.join(words[1:])})" if words[1:] else "")

    def _record(self, member: Member, events, reset: bool) -> None:
        """A member's events (its poll thread). One that starts streaming joins the recording; one whose
        server restarted (`reset`) joins again as a run of its own, "NAME (restart N)"."""
        recorder = self.recorder
        if recorder is None:
            return
        name = self._recorded_as.get(member.name)
        if name is None or reset:
            name = member.name
            restarts = 0
            while name in recorder.engines:
                restarts += 1
                name = f"{member.name} (restart {restarts})"
            recorder.join(name, _engine_header(member))
            self._recorded_as[member.name] = name
        recorder.write(name, events)

    def stop_recording(self) -> str:
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return "not recording"
        for member in self._recorded:
            member.untap(self._record)
        recorder.close()
        return f"recording saved to {recorder.path} ({recorder.num_written} events; " \
               f"batchtop replay {recorder.path} --engine NAME)"

    def on_unmount(self) -> None:
        for member in self.members:
            member.on_rows = None
        self.stop_recording()


def _knob(member: Member, name: str):
    """The member's knob called `name` (or labelled so: "seqs"), None when it has none."""
    return member.source.describe().knob(name) if member.source is not None else None


def _engine_header(member: Member) -> dict:
    """What a log of this engine alone would say about it in its header."""
    source = member.source
    return {"url": member.url, "engine_kind": member.kind(), "model": source.meta.get("model"),
            "knobs": dict(source.knobs), "start_monotonic": source.now(),
            **{k: v for k, v in source.meta.items() if k not in ("model", "kind") and v is not None}}


class FleetApp(App):
    """The fleet screen as an app: the members start with it and stop with it."""

    TITLE = "batchtop fleet"

    def __init__(self, members: list[Member], **screen_kwargs):
        super().__init__()
        self.members = members
        self._screen_kwargs = screen_kwargs

    def on_mount(self) -> None:
        for member in self.members:
            member.start()
        self.fleet = FleetScreen(self.members, **self._screen_kwargs)
        self.push_screen(self.fleet)

    def on_unmount(self) -> None:
        for member in self.members:
            member.close()
