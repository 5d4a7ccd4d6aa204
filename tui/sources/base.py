"""The dashboard's side of a source: `Poll`, `SourceDescription` and the `Source` interface.

A source is polled once per UI tick: `poll()` returns a `Poll` (the new events, and `reset=True`
when the view model must start over, as after seeking backwards in a replay). Commands return an
error string, or None when accepted. `describe()` says what the source can do: its knobs with their
limits, and which of `ABILITIES` it has; the dashboard builds its keys, help and panels from that,
and a command the source lacks is refused with the description's reason.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping

from batchtop.telemetry.events import Event
from batchtop.telemetry.protocol.knob import SCHEDULER_KNOBS, Knob

# What a source may be able to do, in the help's order, as the help names it.
ABILITIES = {
    "pause": "pause and resume",
    "step": "step once",
    "step_back": "step back",
    "seek": "seek to a step",
    "speed": "change the playback speed",
    "knobs": "set knobs",
    "scenarios": "start scenarios",
    "abort": "abort a request",
    "record": "record events",
}
# Why a source that is not a replay lacks the replay's abilities (a description may say otherwise).
REPLAY_ONLY = {"step_back": "only a replay steps back", "seek": "only a replay seeks",
               "speed": "only a replay has a speed"}


@dataclass
class Poll:
    events: list[Event] = field(default_factory=list)
    reset: bool = False


@dataclass(frozen=True)
class SourceDescription:
    """What a source offers. `knobs` and `scenarios` being non-empty is the ability to set knobs and to
    start scenarios; the other abilities are listed in `can`. `why_not` says, for an ability the
    source lacks, why (one line; a default names the source kind)."""
    kind: str
    can: frozenset[str] = frozenset()
    knobs: Mapping[str, Knob] = field(default_factory=dict)      # the knobs it accepts, with its limits
    scenarios: Mapping[str, str] = field(default_factory=dict)   # name -> what to watch
    why_not: Mapping[str, str] = field(default_factory=dict)
    events: bool = True          # per-step events (slot grid, requests, event log); False: scrape panels

    def can_do(self, ability: str) -> bool:
        """`ability` is one of ABILITIES, or "knob:NAME" (this knob is offered)."""
        if ability.startswith("knob:"):
            return ability[5:] in self.knobs
        if ability == "knobs":
            return bool(self.knobs)
        if ability == "scenarios":
            return bool(self.scenarios)
        return ability in self.can

    def why(self, ability: str) -> str:
        """Why the source cannot do `ability` (call when `can_do` is False)."""
        if ability.startswith("knob:") and self.knobs:
            return (f"{ability[5:]} is not a knob of this {self.kind} source; "
                    f"knobs: {', '.join(self.knobs)}")
        if ability.startswith("knob:"):
            ability = "knobs"
        return (self.why_not.get(ability) or REPLAY_ONLY.get(ability)
                or f"this {self.kind} source cannot {ABILITIES[ability]}")

    def refusals(self) -> list[tuple[str, str]]:
        """(what, why) for each ability the source lacks, in ABILITIES order: the help's last lines."""
        return [(what, self.why(ability)) for ability, what in ABILITIES.items() if not self.can_do(ability)]

    def knob(self, name: str) -> Knob | None:
        """The offered knob named `name` or labelled so ("seqs"); None when there is none."""
        return self.knobs.get(name) or next((k for k in self.knobs.values() if k.label == name), None)

    def label(self, name: str) -> str:
        """A knob's short label ("seqs"): from this source's knobs, else the scheduler knobs' table."""
        knob = self.knobs.get(name) or SCHEDULER_KNOBS.get(name)
        return knob.label if knob is not None else name


def disconnected(url: str, last_error: str | None, retry_at: float | None) -> str:
    """The status line of a network source that has lost its server (and when it tries again)."""
    wait = "" if retry_at is None else f"; retrying in {max(0.0, retry_at - time.monotonic()):.1f} s"
    return f"disconnected from {url}: {last_error or 'connecting'}{wait}"


class Source:
    """The interface the dashboard uses. A command this source lacks answers its description's why."""

    kind = "source"
    paused = False
    commands_block = False      # True: a command waits on the network (the app sends it off the UI thread)
    beside: Source | None = None   # a second recording on this one's clock (ReplayPair): the plots draw it

    def __init__(self) -> None:
        self.meta: dict = {}          # model, device, layout, preemption_mode (shown in the header)
        self.knobs: dict = {}         # initial knob values; KnobChanged events keep the model current

    def describe(self) -> SourceDescription:
        return SourceDescription(self.kind)

    def _refuse(self, ability: str) -> str:
        return self.describe().why(ability)

    def poll(self) -> Poll:
        return Poll()

    def now(self) -> float | None:
        """The clock that ages are measured against (None: the newest event time)."""
        return None

    def status(self) -> str:
        return "paused" if self.paused else "live"

    def toggle_pause(self) -> str | None:
        return self._refuse("pause")

    def step_once(self) -> str | None:
        return self._refuse("step")

    def step_back(self) -> str | None:
        return self._refuse("step_back")

    def seek(self, step: int) -> str | None:
        return self._refuse("seek")

    def change_speed(self, faster: bool) -> str | None:
        return self._refuse("speed")

    def set_knob(self, name: str, value) -> str | None:
        return self._refuse(f"knob:{name}")

    def start_scenario(self, name: str, source: str = "tui") -> str:
        return self._refuse("scenarios")

    def abort(self, request_id: str) -> str | None:
        return self._refuse("abort")

    @property
    def recording(self) -> str | None:
        return None

    def start_recording(self, path: str) -> str | None:
        return self._refuse("record")

    def stop_recording(self) -> str | None:
        return "not recording"

    def close(self) -> None:
        pass
