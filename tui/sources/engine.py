"""EngineSource: the in-process engine on its EngineLoop thread: the dashboard's adapter to the engine.

The one tui module (with the command modules) that imports batchtop.engine: knobs from the engine's
knob table, scenarios from its workload, the model loaded by `create`.
"""
from __future__ import annotations

import time

from batchtop.engine.core.knobs import DASHBOARD_KNOBS, KNOBS, LOAD_KNOB_ROWS
from batchtop.engine.workload.arrivals import LOAD_KNOBS
from batchtop.engine.workload.scenarios import SCENARIOS
from batchtop.telemetry.events import EventsDropped

from .base import Poll, Source, SourceDescription


class EngineSource(Source):
    """The in-process engine: an `EngineLoop` thread, events through an `EventBus` subscription.

    Build it with `EngineSource.create(config, ...)` (loads the model: call it off the UI
    thread) or hand in the parts. Knob changes go through `EngineLoop.set_knob` (validated
    at once, applied before the next step); the load knobs through `EngineLoop.set_load_knob`,
    which the engine announces as KnobChanged(source="tui") so they reach the log and recordings.
    """

    kind = "engine"

    def describe(self) -> SourceDescription:
        knobs = {name: KNOBS[name] for name in DASHBOARD_KNOBS}
        if "load_rate" in self.knobs:
            knobs.update(LOAD_KNOB_ROWS)
        return SourceDescription(self.kind, can=frozenset({"pause", "step", "abort", "record"}), knobs=knobs,
                                 scenarios={name: s.watch for name, s in SCENARIOS.items()})

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
        if getattr(self.engine, "kernels_off", None):
            self.meta["kernels"] = f"C++ kernels off ({self.engine.kernels_off}): torch ops serve, slower"
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
        from batchtop.engine.whatif.recording import engine_header
        from batchtop.telemetry.recorder import Recorder
        if self._recorder is not None:
            return f"already recording to {self._recorder.path}"
        try:
            self._recorder = Recorder(path, model=self.meta.get("model"), knobs=self._current_knobs(),
                                      bus=self.bus,
                                      header_extra={**{k: v for k, v in self.meta.items() if k != "model"},
                                                    "engine": engine_header(self.engine)})
        except OSError as error:
            return f"cannot record to {path}: {error}"
        self.loop.request_snapshot("subscribe")  # a recording begun on a busy engine starts from its state
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
