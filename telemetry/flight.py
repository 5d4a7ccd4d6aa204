"""The flight recorder: the engine's last steps of events, always kept, written out when something goes wrong.

The engine tees every event into a `FlightRecorder`: a deque append and a count on the engine
thread, no lock, no allocation. `dump()` writes the newest `max_steps` steps as an ordinary event
log (docs/events.md) whose header carries `"flight_recorder"` (why, which steps); `batchtop replay`
opens such a log at its last step. The engine dumps on a step that raises; `install_signal_handlers()`
dumps every live recorder on SIGTERM and SIGINT, and the CLI calls `dump_all()` when it exits with
an error. A dump goes to a temporary file renamed into place, so even a kill mid-dump leaves
either the whole log or none.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import weakref
from collections import deque
from typing import Callable

from .events import Event, EventsDropped
from .recorder import _encode, encode_event, make_header

DEFAULT_STEPS = 256
DEFAULT_MAX_EVENTS = 20_000    # a cap whatever the steps hold: ~5 MB of events at most
MAX_DUMPS = 8                  # per recorder: a step that fails again and again does not fill the disk
DIR_ENV_VAR = "BATCHTOP_FLIGHT_DIR"

Sink = Callable[[Event], None]

_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_previous_handlers: dict[int, object] = {}


def flight_dir() -> str:
    """Where dumps go: $BATCHTOP_FLIGHT_DIR, else the user cache's batchtop/flight."""
    return os.environ.get(DIR_ENV_VAR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "batchtop", "flight")


class FlightRecorder:
    """A bounded ring of the newest events: the newest `max_steps` steps, at most `max_events` events.

    `header` returns the log header's fields at dump time (`model`, `knobs`, ...).
    """

    def __init__(self, max_steps: int = DEFAULT_STEPS, *, max_events: int = DEFAULT_MAX_EVENTS,
                 header: Callable[[], dict] | None = None, directory: str | None = None):
        if max_steps < 1 or max_events < 1:
            raise ValueError(f"a flight recorder keeps at least one step and one event, got {max_steps}, "
                             f"{max_events}")
        self.max_steps = max_steps
        self.header = header or dict
        self.directory = directory
        self.num_events = 0              # ever recorded; what the ring lost is this minus what it holds
        self.paths: list[str] = []       # dumps written, oldest first
        self._ring: deque[Event] = deque(maxlen=max_events)
        self._num_events_dumped = -1
        self._dump_lock = threading.Lock()
        _live.add(self)

    def __call__(self, event: Event) -> None:
        self._ring.append(event)
        self.num_events += 1

    def tee(self, sink: Sink | None) -> Sink:
        """The engine's sink: this ring, then `sink` (when given). A closure, not the bound
        `__call__`: half the cost per event (docs/reliability.md)."""
        append = self._ring.append
        if sink is None:
            def record(event: Event) -> None:
                append(event)
                self.num_events += 1
            return record

        def record_and_forward(event: Event) -> None:
            append(event)
            self.num_events += 1
            sink(event)
        return record_and_forward

    def events(self) -> list[Event]:
        """The newest `max_steps` steps, oldest first; an EventsDropped first when older events were lost."""
        num_events = self.num_events
        ring = self._ring.copy()          # one C call under the GIL: safe while the engine appends
        if not ring:
            return []
        first_step = ring[-1].step - self.max_steps + 1
        start = 0
        while ring[start].step < first_step:
            start += 1
        kept = list(ring)[start:]
        lost = max(0, num_events - len(ring)) + start
        if lost:
            return [EventsDropped(step=kept[0].step, t=kept[0].t, count=lost), *kept]
        return kept

    def dump(self, reason: str, error: str | None = None) -> str | None:
        """Write the ring to a new log; its path (also said on stderr), or None when nothing new was
        recorded since the last dump, the dump budget is spent, or the file could not be written."""
        with self._dump_lock:
            if self.num_events == self._num_events_dumped or len(self.paths) >= MAX_DUMPS:
                return None
            self._num_events_dumped = self.num_events
            events = self.events()
            if not events:
                return None
            try:
                path = self._write(events, reason, error)
            except OSError as failure:
                print(f"batchtop: flight recorder: could not write its log: {failure}", file=sys.stderr)
                return None
            self.paths.append(path)
        steps = f"steps {events[0].step}-{events[-1].step}"
        print(f"batchtop: flight recorder ({reason}): {steps} written to {path} "
              f"(open it with: batchtop replay {path})", file=sys.stderr)
        return path

    def _write(self, events: list[Event], reason: str, error: str | None) -> str:
        directory = self.directory or flight_dir()
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = os.path.join(directory, f"flight-{stamp}-{os.getpid()}-step{events[-1].step}.jsonl")
        fields = dict(self.header())
        header = make_header(fields.pop("model", None), fields.pop("knobs", None), **fields,
                             flight_recorder={"reason": reason, "error": error, "first_step": events[0].step,
                                              "last_step": events[-1].step, "num_events": len(events)})
        temporary = f"{path}.partial"
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(_encode(header) + "\n")
            out.write("".join([encode_event(e) + "\n" for e in events]))
        os.replace(temporary, path)
        return path


def dump_all(reason: str, error: str | None = None) -> list[str]:
    """Dump every live flight recorder that recorded something new; the paths written."""
    return [path for recorder in list(_live) if (path := recorder.dump(reason, error)) is not None]


def install_signal_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
    """On each of `signals`, dump every live recorder, then do what the signal did before
    (SIGINT: KeyboardInterrupt; SIGTERM: end the process). A signal the process was started with
    ignored (nohup, a shell's background job) stays ignored: it does not end the process, so it is no
    reason to write a log. Main thread only; idempotent."""
    for signum in signals:
        previous = signal.getsignal(signum)
        if previous is not _on_signal and previous != signal.SIG_IGN:
            _previous_handlers[signum] = previous
            signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame) -> None:
    dump_all(f"signal {signal.Signals(signum).name}")
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
