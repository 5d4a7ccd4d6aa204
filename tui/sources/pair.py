"""ReplayPair: a recording replayed with a second one beside it, both on one clock.

The clock counts seconds since each recording's start, its first event (a what-if output's virtual clock
starts at its original's first event: the two line up), so both show the same moment of their own run.
Play, pause and speed move the clock; step, step back and seek go by the main recording's steps and
the second one follows to the same time. The clock runs until the longer recording ends. Every panel
shows the main recording; the plots draw the second one too (`beside`, `beside_shift`).
"""
from __future__ import annotations

import bisect
import os
import time
from typing import Callable

from batchtop.telemetry.fleet_log import engine_names
from batchtop.telemetry.recorder import LogReader, read_header

from .base import Poll, Source, SourceDescription
from .replay import REPLAY_SPEEDS, ReplaySource


def _frozen() -> float:
    """The two recordings' own clock: they never move by themselves, the pair's clock moves them."""
    return 0.0


class ReplayPair(Source):
    """`main` (every panel) and `beside` (the plots too), each a ReplaySource made paused on a fixed
    clock, played on the pair's `clock` (injectable, as ReplaySource's)."""

    kind = "replay"

    def __init__(self, main: ReplaySource, beside: ReplaySource, names: tuple[str, str] = ("A", "B"), *,
                 clock: Callable[[], float] = time.monotonic, speed: float = 1.0, paused: bool = False):
        """`names`: how the header and the plots name the two recordings (their files)."""
        super().__init__()
        self.main, self.beside = main, beside
        self.main_name, self.beside_name = names
        self.meta, self.knobs = main.meta, main.knobs
        self.speed = speed
        self.paused = paused
        self._clock = clock
        self._last_clock = clock()
        self.duration_s = max(_duration(main), _duration(beside))
        self.elapsed_s = main.target_t - main.origin_t      # a crash log opens at its end
        beside.go_to_time(beside.origin_t + self.elapsed_s)

    @classmethod
    def from_files(cls, path: str, beside_path: str, engine: str | None = None,
                   beside_engine: str | None = None, **kwargs) -> ReplayPair:
        """Two logs (of a fleet recording: `engine`; the second's `beside_engine`, else `engine` when it
        is a fleet recording too). OSError when one cannot be read; ValueError (one line) when one is
        not a log, is cut off, or holds no events."""
        if beside_engine is None and engine is not None and engine_names(read_header(beside_path)):
            beside_engine = engine
        main, beside = _read_whole(path, engine), _read_whole(beside_path, beside_engine)
        return cls(main, beside, (_name(path, engine), _name(beside_path, beside_engine)), **kwargs)

    def describe(self) -> SourceDescription:
        return ReplaySource.DESCRIPTION

    @property
    def beside_shift(self) -> float:
        """Add to a time of the main recording to get the same moment of the second one."""
        return self.beside.origin_t - self.main.origin_t

    # -- the clock ------------------------------------------------------------------------------

    def poll(self) -> Poll:
        """The main recording's new events; the screen then polls `beside` for the second one's."""
        clock = self._clock()
        elapsed, self._last_clock = clock - self._last_clock, clock
        if not self.paused and not self.at_end:
            self._stand_at(min(self.duration_s, self.elapsed_s + elapsed * self.speed))
            self.paused = self.at_end
        return self.main.poll()

    @property
    def at_end(self) -> bool:
        return self.elapsed_s >= self.duration_s

    def now(self) -> float | None:
        return self.main.now()

    def status(self) -> str:
        state = "end" if self.at_end else "paused" if self.paused else "playing"
        main, beside = self.main, self.beside
        return (f"replay {state} {self.speed:g}x t {self.elapsed_s:.1f}/{self.duration_s:.1f} s "
                f"step {main.current_step}/{main.last_step} │ beside: {self.beside_name} "
                f"step {beside.current_step}/{beside.last_step}")

    def toggle_pause(self) -> str | None:
        if self.at_end and self.paused:
            self._stand_at(0.0)
        self.paused = not self.paused
        return None

    def _stand_at(self, elapsed_s: float) -> None:
        self.elapsed_s = elapsed_s
        self.main.go_to_time(self.main.origin_t + elapsed_s)
        self.beside.go_to_time(self.beside.origin_t + elapsed_s)

    def _follow_main(self, error: str | None) -> str | None:
        """After the main recording moved by steps: pause, and bring the clock and the second one there."""
        self.paused = True
        self.elapsed_s = self.main.target_t - self.main.origin_t
        self.beside.go_to_time(self.beside.origin_t + self.elapsed_s)
        return error

    # -- steps and seeks: the main recording's ------------------------------------------------------

    def step_once(self) -> str | None:
        if self.elapsed_s >= _duration(self.main) and not self.at_end:   # the second one runs on: step it
            self.paused = True
            self.beside.step_once()
            self.elapsed_s = min(self.duration_s, self.beside.target_t - self.beside.origin_t)
            self.main.go_to_time(self.main.origin_t + self.elapsed_s)
            return None
        return self._follow_main(self.main.step_once())

    def step_back(self) -> str | None:
        return self._follow_main(self.main.step_back())

    def seek(self, step: int) -> str | None:
        return self._follow_main(self.main.seek(step))

    def change_speed(self, faster: bool) -> str | None:
        i = bisect.bisect_left(REPLAY_SPEEDS, self.speed) + (1 if faster else -1)
        self.speed = REPLAY_SPEEDS[min(max(i, 0), len(REPLAY_SPEEDS) - 1)]
        return None


def _read_whole(path: str, engine: str | None) -> ReplaySource:
    """A comparison needs whole runs: a log cut off mid-line would look like a run that stopped."""
    with LogReader(path, engine) as log:
        header, events = log.header, list(log)
        if log.truncated:
            raise ValueError(f"{path}: the recording is truncated (its last line is cut off): replaying "
                             "it beside another needs it whole; replay it alone")
    if not events:
        raise ValueError(f"{path}: the recording holds no events: nothing to replay beside another")
    return ReplaySource(header, events, clock=_frozen, paused=True)


def _duration(source: ReplaySource) -> float:
    return source.events[-1].t - source.origin_t if source.events else 0.0


def _name(path: str, engine: str | None) -> str:
    return os.path.basename(path) + (f" (engine {engine})" if engine else "")
