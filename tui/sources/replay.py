"""ReplaySource: a recorded log played through the dashboard (play/pause, speed, step, step back,
seek); knobs, aborts and scenarios are refused, as a recording cannot change."""
from __future__ import annotations

import bisect
import time
from typing import Callable

from batchtop.telemetry.events import Event, StepFinished

from .base import Poll, Source, SourceDescription

REPLAY_SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0)
READ_ONLY = "replay: knobs are read-only"


class ReplaySource(Source):
    """Plays a recorded log through the dashboard.

    Playback time advances by wall time × speed; `clock` is injectable so that tests
    (and snapshots) are deterministic: with a constant clock nothing moves until
    `step_once` / `seek`. A poll emits at most `max_events_per_poll` events so a big
    jump never freezes the UI.
    """

    kind = "replay"
    DESCRIPTION = SourceDescription(kind, can=frozenset({"pause", "step", "step_back", "seek", "speed"}),
                                    why_not={"knobs": READ_ONLY, "scenarios": READ_ONLY, "abort": READ_ONLY,
                                             "record": "a replay is a recording already"})

    def __init__(self, header: dict, events: list[Event], *, clock: Callable[[], float] = time.monotonic,
                 speed: float = 1.0, paused: bool = False, max_events_per_poll: int = 20_000):
        super().__init__()
        self.header = header
        self.events = events
        self.meta = {k: header.get(k) for k in ("model", "device", "layout", "preemption_mode", "kernels")
                     if header.get(k)}
        self.knobs = dict(header.get("knobs") or {})
        self.meta.setdefault("layout", self.knobs.get("layout"))
        self.meta.setdefault("preemption_mode", self.knobs.get("preemption_mode"))
        self.speed = speed
        self.paused = paused
        self.max_events_per_poll = max_events_per_poll
        self._clock = clock
        self._last_clock = clock()
        self._cursor = 0                      # index of the next event to hand out
        self._reset = False
        # Time 0 of the recording: its first event; a what-if output's virtual clock counts from its
        # original's first event already.
        self.origin_t = 0.0 if header.get("whatif") else events[0].t if events else 0.0
        self.position_t = events[0].t if events else 0.0
        self._pending_t: float | None = None  # where a time seek stands once its events are out
        # Step boundaries: the index just past each StepFinished, and its step number.
        self._finish_ends = [i + 1 for i, e in enumerate(events) if type(e) is StepFinished]
        self._finish_steps = [events[i - 1].step for i in self._finish_ends]
        if header.get("flight_recorder"):     # a crash log: open where it ended, the failing step shown
            self._go_to(len(events))

    def describe(self) -> SourceDescription:
        return self.DESCRIPTION

    @classmethod
    def from_file(cls, path: str, engine: str | None = None, **kwargs) -> ReplaySource:
        """The log at `path` (one engine of a fleet recording: `engine`; LogFormatError names them)."""
        from batchtop.telemetry.recorder import read_log
        header, events = read_log(path, engine)
        return cls(header, events, **kwargs)

    # -- playback -----------------------------------------------------------------------------

    def poll(self) -> Poll:
        clock = self._clock()
        elapsed, self._last_clock = clock - self._last_clock, clock
        out = Poll(reset=self._reset)
        self._reset = False
        if self._pending_end is not None:
            out.events = self._take(self._pending_end)
            if self._cursor >= self._pending_end:
                self._pending_end = None
                if self._pending_t is not None:
                    self.position_t, self._pending_t = self._pending_t, None
            return out
        if self.paused or self.at_end:
            return out
        target = self.position_t + elapsed * self.speed
        end = self._cursor
        events = self.events
        while end < len(events) and events[end].t <= target:
            end += 1
        out.events = self._take(end)
        if self._cursor == end:
            self.position_t = target
        if self.at_end:
            self.paused = True
        return out

    _pending_end: int | None = None

    def _take(self, end: int) -> list[Event]:
        """Events from the cursor up to `end` (exclusive), at most max_events_per_poll of them."""
        end = min(end, self._cursor + self.max_events_per_poll)
        chunk = self.events[self._cursor:end]
        self._cursor = end
        if chunk:
            self.position_t = chunk[-1].t
        return chunk

    def _go_to(self, end: int) -> None:
        """Make the next polls hand out events up to index `end`, restarting when it lies behind."""
        self._pending_end = self._pending_t = None
        if end < self._cursor:
            self._cursor = 0
            self._reset = True
            self.position_t = self.events[0].t if self.events else 0.0
        self._pending_end = end
        self.paused = True

    def go_to_time(self, t: float) -> None:
        """Make the next polls hand out every event up to time `t` and then stand at `t` (a pair's clock
        drives its two recordings so); pauses this source's own playback."""
        events, end = self.events, self._position
        while end > 0 and events[end - 1].t > t:
            end -= 1
        while end < len(events) and events[end].t <= t:
            end += 1
        self._go_to(end)
        self._pending_t = t

    @property
    def target_t(self) -> float:
        """The time shown once the pending events are handed out."""
        if self._pending_t is not None:
            return self._pending_t
        return self.events[self._position - 1].t if self._position else self.origin_t

    @property
    def _position(self) -> int:
        """Where the cursor will be once the pending seek is handed out."""
        return self._pending_end if self._pending_end is not None else self._cursor

    @property
    def at_end(self) -> bool:
        return self._cursor >= len(self.events)

    @property
    def current_step(self) -> int:
        return self.events[self._cursor - 1].step if self._cursor else 0

    @property
    def last_step(self) -> int:
        return self.events[-1].step if self.events else 0

    def now(self) -> float | None:
        return self.position_t

    def status(self) -> str:
        state = "end" if self.at_end else "paused" if self.paused else "playing"
        return f"replay {state} {self.speed:g}x step {self.current_step}/{self.last_step}"

    def toggle_pause(self) -> str | None:
        if self.at_end and self.paused:
            self._go_to(0)
            self._pending_end = None
            self.paused = False
            return None
        self.paused = not self.paused
        return None

    def step_once(self) -> str | None:
        """Hand out everything up to and including the next StepFinished; pauses playback."""
        pos = self._position
        i = bisect.bisect_right(self._finish_ends, pos)
        if i >= len(self._finish_ends):
            if pos >= len(self.events):
                return "end of the log"
            self._go_to(len(self.events))
            return None
        self._go_to(self._finish_ends[i])
        return None

    def step_back(self) -> str | None:
        """Back to the end of the step before the one shown (replays from the start)."""
        pos = self._position
        k = bisect.bisect_left(self._finish_ends, pos)
        if k == 0:
            if pos == 0:
                return "already at the start"
            self._go_to(0)
        else:
            self._go_to(self._finish_ends[k - 1])
        return None

    def seek(self, step: int) -> str | None:
        """Show the dashboard as it was when step `step` finished (clamped to the log)."""
        i = bisect.bisect_right(self._finish_steps, step) - 1
        self._go_to(self._finish_ends[i] if i >= 0 else 0)
        return None

    def change_speed(self, faster: bool) -> str | None:
        i = bisect.bisect_left(REPLAY_SPEEDS, self.speed) + (1 if faster else -1)
        self.speed = REPLAY_SPEEDS[min(max(i, 0), len(REPLAY_SPEEDS) - 1)]
        return None
