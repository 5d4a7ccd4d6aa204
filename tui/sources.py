"""Where the dashboard's events come from, and where its commands go.

A source is polled once per UI tick: `poll()` returns a `Poll` (the new events, and
`reset=True` when the view model must start over, as after seeking backwards in a
replay). Commands return an error string, or None when accepted; a source that cannot
do something (knobs in a replay) says so in that string.

- `ReplaySource`: a recorded log; play/pause, speed, step forward/back, seek; read-only.
- `EngineSource`: the in-process engine on its `EngineLoop` thread, events through an
  `EventBus` subscription, the built-in Poisson load generator, recording via `Recorder`.
- `FeedSource`: events pushed by the caller (tests, synthetic streams).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

from batchtop.engine.core.knobs import DASHBOARD_KNOBS, KNOBS, LOAD_KNOB_ROWS
from batchtop.engine.workload.arrivals import LOAD_KNOBS
from batchtop.telemetry.events import Event, EventsDropped, StepFinished
from batchtop.telemetry.protocol.knob import Knob

REPLAY_SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0, 256.0)
READ_ONLY = "replay: knobs are read-only"


@dataclass
class Poll:
    events: list[Event] = field(default_factory=list)
    reset: bool = False


class Source:
    """The interface the app uses; defaults refuse politely."""

    kind = "source"
    read_only = True
    paused = False
    commands_block = False      # True: a command waits on the network (the app sends it off the UI thread)

    def __init__(self) -> None:
        self.meta: dict = {}          # model, device, layout, preemption_mode (shown in the header)
        self.knobs: dict = {}         # initial knob values; KnobChanged events keep the model current

    def poll(self) -> Poll:
        return Poll()

    def now(self) -> float | None:
        """The clock that ages are measured against (None: the newest event time)."""
        return None

    def status(self) -> str:
        return "paused" if self.paused else "live"

    def toggle_pause(self) -> str | None:
        return "this source cannot pause"

    def step_once(self) -> str | None:
        return "this source cannot step"

    def step_back(self) -> str | None:
        return "only a replay steps back"

    def seek(self, step: int) -> str | None:
        return "only a replay seeks"

    def change_speed(self, faster: bool) -> str | None:
        return "only a replay has a speed"

    def offered_knobs(self) -> dict[str, Knob]:
        """The knobs the dashboard's keys and prompt may set over this source (none when read-only)."""
        return {}

    def set_knob(self, name: str, value) -> str | None:
        return READ_ONLY

    def start_scenario(self, name: str, source: str = "tui") -> str:
        return READ_ONLY

    def abort(self, request_id: str) -> str | None:
        return READ_ONLY

    @property
    def recording(self) -> str | None:
        return None

    def start_recording(self, path: str) -> str | None:
        return "this source cannot record"

    def stop_recording(self) -> str | None:
        return "not recording"

    def close(self) -> None:
        pass


class FeedSource(Source):
    """Events handed in by `push`; the next poll returns them. Optional fixed clock for `now`."""

    kind = "feed"

    def __init__(self, knobs: dict | None = None, meta: dict | None = None,
                 clock: Callable[[], float] | None = None):
        super().__init__()
        self.knobs = dict(knobs or {})
        self.meta = dict(meta or {})
        self._pending: list[Event] = []
        self._clock = clock

    def push(self, events) -> None:
        self._pending.extend(events)

    def poll(self) -> Poll:
        events, self._pending = self._pending, []
        return Poll(events)

    def now(self) -> float | None:
        return self._clock() if self._clock else None


class ReplaySource(Source):
    """Plays a recorded log through the dashboard.

    Playback time advances by wall time × speed; `clock` is injectable so that tests
    (and snapshots) are deterministic: with a constant clock nothing moves until
    `step_once` / `seek`. A poll emits at most `max_events_per_poll` events so a big
    jump never freezes the UI.
    """

    kind = "replay"

    def __init__(self, header: dict, events: list[Event], *, clock: Callable[[], float] = time.monotonic,
                 speed: float = 1.0, paused: bool = False, max_events_per_poll: int = 20_000):
        super().__init__()
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
        self.position_t = events[0].t if events else 0.0
        # Step boundaries: the index just past each StepFinished, and its step number.
        self._finish_ends = [i + 1 for i, e in enumerate(events) if type(e) is StepFinished]
        self._finish_steps = [events[i - 1].step for i in self._finish_ends]
        if header.get("flight_recorder"):     # a crash log: open where it ended, the failing step shown
            self._go_to(len(events))

    @classmethod
    def from_file(cls, path: str, **kwargs) -> ReplaySource:
        from batchtop.telemetry.recorder import read_log
        header, events = read_log(path)
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
        self._pending_end = None
        if end < self._cursor:
            self._cursor = 0
            self._reset = True
            self.position_t = self.events[0].t if self.events else 0.0
        self._pending_end = end
        self.paused = True

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


class EngineSource(Source):
    """The in-process engine: an `EngineLoop` thread, events through an `EventBus` subscription.

    Build it with `EngineSource.create(config, ...)` (loads the model: call it off the UI
    thread) or hand in the parts. Knob changes go through `EngineLoop.set_knob` (validated
    at once, applied before the next step); the load knobs through `EngineLoop.set_load_knob`,
    which the engine announces as KnobChanged(source="tui") so they reach the log and recordings.
    """

    kind = "engine"
    read_only = False

    def offered_knobs(self) -> dict[str, Knob]:
        offered = {name: KNOBS[name] for name in DASHBOARD_KNOBS}
        if "load_rate" in self.knobs:
            offered.update(LOAD_KNOB_ROWS)
        return offered

    def __init__(self, loop, bus, *, subscription_maxlen: int = 100_000, model: str | None = None):
        super().__init__()
        self.loop = loop
        self.engine = loop.engine
        self.bus = bus
        self.subscription = bus.subscribe(subscription_maxlen)
        loop.request_snapshot("subscribe")       # a dashboard that joins a running engine starts exact
        self.knobs = dict(self.engine.knobs())
        self.knobs["block_size"] = self.engine.config.block_size
        load = loop.load
        if load is not None and hasattr(load, "rate"):
            self.knobs["load_rate"] = load.rate
            self.knobs["length_dist"] = load.output.kind
        config = self.engine.config
        self.meta = {"model": model or config.model, "device": _device_name(self.engine),
                     "layout": config.layout, "preemption_mode": self.knobs.get("preemption_mode")}
        if getattr(self.engine, "kernel_note", None):
            self.meta["kernels"] = self.engine.kernel_note
        self._recorder = None
        self._paused = False

    @classmethod
    def create(cls, config, *, load_rate: float = 2.0, length_dist: str = "exponential",
               prompt_mean: float = 64.0, output_mean: float = 64.0, seed: int = 0, history: int = 0):
        """Load the model, build engine, bus, load generator and loop; the loop is not started yet."""
        from batchtop.engine.core.engine import Engine
        from batchtop.engine.core.loop import EngineLoop
        from batchtop.engine.workload.arrivals import LengthDist, PoissonLoad
        from batchtop.telemetry.bus import EventBus
        bus = EventBus(history=history)
        engine = Engine(config, sink=bus.publish)
        load = None
        if load_rate is not None:
            load = PoissonLoad(load_rate, LengthDist(length_dist, mean=prompt_mean, high=512),
                               LengthDist(length_dist, mean=output_mean, high=512), seed=seed)
        loop = EngineLoop(engine, load=load, load_seed=seed)
        return cls(loop, bus, model=config.model)

    def start(self) -> EngineSource:
        if not self.loop.running:
            self.loop.start()
        return self

    def poll(self) -> Poll:
        events = self.subscription.drain()
        if events and isinstance(events[0], EventsDropped):
            self.loop.request_snapshot("drop")   # per-request state is stale until the snapshot arrives
        return Poll(events)

    def now(self) -> float | None:
        return time.monotonic()           # the engine's clock: same process

    @property
    def paused(self) -> bool:
        return self._paused

    def status(self) -> str:
        if self.loop.error is not None:
            return f"engine failed: {self.loop.error!r}"
        return "paused" if self._paused else "live"

    def toggle_pause(self) -> str | None:
        self._paused = not self._paused
        (self.loop.pause if self._paused else self.loop.resume)()
        return None

    def step_once(self) -> str | None:
        if not self._paused:
            return "pause first (space), then step"
        self.loop.step_once()
        return None

    def set_knob(self, name: str, value) -> str | None:
        if name in LOAD_KNOBS:
            return self._set_load_knob(name, value)
        return self.loop.set_knob(name, value, "tui")

    def _set_load_knob(self, name: str, value) -> str | None:
        return self.loop.set_load_knob(name, value, "tui")

    def start_scenario(self, name: str, source: str = "tui") -> str:
        """Switch to scenario `name` live; what to watch, and what only a restart with it would change."""
        from batchtop.engine.workload.scenarios import SCENARIOS
        scenario = SCENARIOS[name]
        self.loop.start_scenario(scenario, source)
        fixed = {k: v for k, v in scenario.config.items() if k not in self.engine.knobs()
                 and getattr(self.engine.config, k, v) != v}
        note = ("; needs `batchtop --scenario " + name + "` for "
                + ", ".join(f"{k}={v}" for k, v in fixed.items())
                if fixed else "")
        return f"scenario {name}: {scenario.watch}{note}"

    def abort(self, request_id: str) -> str | None:
        self.loop.abort(request_id)
        return None

    @property
    def recording(self) -> str | None:
        return self._recorder.path if self._recorder is not None else None

    def start_recording(self, path: str) -> str | None:
        from batchtop.telemetry.recorder import Recorder
        if self._recorder is not None:
            return f"already recording to {self._recorder.path}"
        try:
            self._recorder = Recorder(path, model=self.meta.get("model"), knobs=self._current_knobs(),
                                      bus=self.bus,
                                      header_extra={k: v for k, v in self.meta.items() if k != "model"})
        except OSError as error:
            return f"cannot record to {path}: {error}"
        return None

    def _current_knobs(self) -> dict:
        knobs = dict(self.engine.knobs())
        knobs.update({k: self.knobs[k] for k in ("block_size", "load_rate",
                                                 "length_dist") if k in self.knobs})
        load = self.loop.load
        if load is not None and hasattr(load, "rate"):
            knobs["load_rate"], knobs["length_dist"] = load.rate, load.output.kind
        return knobs

    def stop_recording(self) -> str | None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:
            return "not recording"
        try:
            recorder.close()
        except RuntimeError as error:
            return str(error)
        return None

    def close(self) -> None:
        self.stop_recording()
        self.loop.stop()
        self.subscription.close()


def _device_name(engine) -> str:
    """The model's device, and the CUDA graphs captured at start if any (shown in the header)."""
    try:
        device = str(next(engine.loaded.model.parameters()).device)
    except (AttributeError, StopIteration):
        return "cpu"
    graphs = getattr(getattr(engine, "runner", None), "decode_graphs", None)
    capture = getattr(graphs, "capture", None)
    return f"{device} ({capture.summary})" if capture is not None else device
