"""The dashboard's keys, as three mixins of DashboardScreen (tui/dashboard.py): control of the source
(pause, step, seek, abort, record), knobs, and what the views show. Each action reads the screen's
source, model and widgets, and answers on its status line (`say`, `_answer`); a command that waits on
the network goes through the screen's `command` (a worker thread, its answer a message)."""
from __future__ import annotations

import time

from textual.actions import parse

from batchtop.telemetry.protocol.knob import number_text

from .keys import KEYS
from .plots import PLOT_WINDOWS_S
from .screens import ConfirmScreen, HelpScreen, PromptScreen, knob_assignment
from .tables import COLUMNS


class ControlActions:
    """Pause, step, step back, speed, seek, abort, record, help, back."""

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


class KnobActions:
    """Knobs by prompt (`k`), by key (×2, ÷2, cycle), and the next scenario; only the source's own knobs,
    within their limits (a vLLM knob ends at its start value)."""

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
                self.say(f"{name} is at its limit of {number_text(high)} over this source", error=True)
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


class ViewActions:
    """Which view shows, the request table's selection, sort and filter, the event log's filter and
    freeze, the plots' window."""

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


def _coerce(value):
    """'32' → 32, '1.5' → 1.5, anything else unchanged (for the optimistic knob display)."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value
