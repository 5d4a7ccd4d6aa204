"""The engine on its own thread: commands in through the protocol's `CommandQueue`, applied between steps.

Callers on other threads (the dashboard, the server) never touch the engine directly:
they validate here, synchronously, and queue the change (a full queue raises `QueueFull`,
nothing queued is lost). The loop never waits on an observer: events leave through the
engine's sink, outputs through per-request callbacks that must not block.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import threading
import time
from typing import Callable

from batchtop.engine.workload.arrivals import check_load_knob, item_prompt, synthetic_prompt
from batchtop.telemetry.protocol.commands import CommandQueue

from . import heap, openmp
from .engine import Engine, RequestOutput
from .sampling import SamplingParams

OutputCallback = Callable[[RequestOutput], None]


class EngineLoop:
    def __init__(self, engine: Engine, load=None, load_seed: int = 0):
        self.engine = engine
        self.load = load                      # anything with due(elapsed_s) and next_arrival_s(), or None
        self._load_rng = random.Random(load_seed)
        self.commands = CommandQueue(on_paused=engine.note_paused, on_error=engine.refuse)
        self._listeners: dict[str, OutputCallback] = {}
        self._adds_submitted = 0              # add_request calls queued (callers' threads, under the lock)
        self._adds_applied = 0                # ... and taken by the engine thread
        self._adds_lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._load_paused = False             # the load was held by a pause ...
        self._load_resumed_at = 0.0           # ... until then
        self.error: BaseException | None = None
        # (step, seq, fn): run after that step
        self._scheduled: list[tuple[int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.scenario: str | None = None

    # -- life --------------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        openmp.release_workers()              # the caller's: the engine thread's team is then the only one
        heap.freeze()                         # no full collection of the start-up heap mid-step
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="batchtop-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.commands.wake()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def paused(self) -> bool:
        return self.commands.paused

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def served_load(self) -> bool:
        """A trace load has handed out its last request and the engine has finished every request
        (any thread)."""
        return self.load.exhausted and not self.call(self.engine.has_unfinished)

    # -- commands (any thread) ---------------------------------------------------------------

    def call(self, fn: Callable[[], object], timeout: float = 30.0):
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        done = threading.Event()
        box: dict[str, object] = {}

        def command():
            try:
                box["value"] = fn()
            except BaseException as error:   # handed back to the caller
                box["error"] = error
            done.set()

        self.commands.submit(command)
        if not done.wait(timeout):
            raise TimeoutError("the engine did not answer in time")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def set_knob(self, name: str, value, source: str = "api") -> str | None:
        """Validate now; apply before the next step. The error message, or None when accepted."""
        try:
            value = self.engine.validate_knob(name, value)
        except ValueError as error:
            message = str(error)
            self.commands.submit(lambda: self.engine.refuse(f"set {name}", message))
            return message
        self.commands.submit(lambda: self.engine.set_knob(name, value, source))
        return None

    def set_load_knob(self, name: str, value, source: str = "api") -> str | None:
        """The built-in load's knobs: `load_rate` (requests/s) and `length_dist` (prompt and output
        distribution kind). Validated now, applied on the engine thread, announced as KnobChanged."""
        load = self.load
        if load is None or not hasattr(load, "set_rate"):
            return "no load generator is running"
        try:
            value = check_load_knob(name, value)
        except ValueError as error:
            return str(error)

        def apply():
            if name == "load_rate":
                old = load.rate
                load.set_rate(value)
            else:
                old = load.output.kind
                load.prompt = dataclasses.replace(load.prompt, kind=value)
                load.output = dataclasses.replace(load.output, kind=value)
            self.engine.note_knob(name, old, value, source)
        self.commands.submit(apply)
        return None

    def pause(self) -> None:
        self.commands.pause()

    def resume(self) -> None:
        self.commands.resume()

    def step_once(self) -> None:
        """While paused: run exactly one more step."""
        self.commands.step_once()

    def start_scenario(self, scenario, source: str = "tui") -> None:
        """From the next step: the scenario's knobs that can change live, its load, and its scripted
        requests and knob phases, their steps counted from now (engine/workload/scenarios.py). Settings
        fixed at start (the KV pool, the layout) stay as they are; `batchtop --scenario NAME` sets them."""
        def apply():
            engine = self.engine
            knobs = engine.knobs()
            for name, value in scenario.config.items():
                if name in knobs and knobs[name] != value:
                    engine.set_knob(name, value, source)
            load, old = scenario.load(self._load_rng.randrange(1 << 30)), self.load
            load.start_at(time.monotonic() - self._started_at)
            self.load = load
            if old is not None and getattr(old, "rate", None) != load.rate:
                engine.note_knob("load_rate", getattr(old, "rate", None), load.rate, source)
            self._scheduled.clear()
            base = engine.step_count
            for step, prompt_tokens, output_tokens in scenario.script:
                self._at(base + step, lambda p=prompt_tokens, o=output_tokens: self._add_scripted(p, o))
            for step, name, value in scenario.phases:
                self._at(base + step, lambda n=name, v=value: engine.set_knob(n, v, source))
            engine.note_knob("scenario", self.scenario, scenario.name, source)
            self.scenario = scenario.name
            self._run_scheduled()                 # what is due at once
        self.commands.submit(apply)

    def _at(self, step: int, fn: Callable[[], None]) -> None:
        heapq.heappush(self._scheduled, (step, next(self._seq), fn))

    def _run_scheduled(self) -> None:
        scheduled, done = self._scheduled, self.engine.step_count
        while scheduled and scheduled[0][0] <= done:
            _, _, fn = heapq.heappop(scheduled)
            try:
                fn()
            except ValueError as error:
                self.engine.refuse("scenario", str(error))

    def _add_scripted(self, prompt_tokens: int, output_tokens: int) -> None:
        self.engine.add_request(synthetic_prompt(prompt_tokens, self._load_rng),
                                SamplingParams(max_tokens=output_tokens, ignore_eos=True))

    def request_snapshot(self, cause: str = "request") -> None:
        """Have the engine publish an EngineSnapshot before its next step (a consumer joined or lost
        events); asks while one waits coalesce into it."""
        self.commands.submit(lambda: self.engine.emit_snapshot(cause), key="snapshot")

    def abort(self, request_id: str) -> None:
        self.commands.submit(lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self._deliver(RequestOutput(request_id, [], True, "abort"))

    def add_request(self, prompt, sampling: SamplingParams | None = None, *,
                    on_output: OutputCallback | None = None, chat: bool = False, priority: int = 0,
                    request_id: str | None = None, received_time: float | None = None) -> str:
        """Validate now (ValueError on bad input), queue for the next step; outputs go to `on_output`.
        `received_time` (time.monotonic()): when a server received the request, its arrival."""
        request = self.engine.make_request(prompt, sampling, chat=chat, priority=priority,
                                           request_id=request_id, received_time=received_time)

        def enqueue():
            self._adds_applied += 1
            if on_output is not None:
                self._listeners[request.request_id] = on_output
            self.engine.enqueue(request)
        with self._adds_lock:
            self.commands.submit(enqueue)          # QueueFull: nothing queued, nothing counted
            self._adds_submitted += 1
        return request.request_id

    @property
    def num_waiting(self) -> int:
        """Requests queued or waiting for admission (read from any thread: a close estimate)."""
        return len(self.engine.scheduler.waiting) + self._adds_submitted - self._adds_applied

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._admit_load()
                commands = self.commands
                can_step = self.engine.has_unfinished() and commands.may_step()
                commands.apply(0 if can_step else self._idle_wait())
                if self._stopping:
                    break
                if self._scheduled:
                    self._run_scheduled()         # a scenario's requests and knob phases that are due
                if not self.engine.has_unfinished() or not commands.take_step():
                    continue
                step_before = self.engine.step_count
                try:
                    outputs = self.engine.step()
                except Exception:            # marked and logged by the engine: retire its batch, serve on
                    outputs = self.engine.fail_running()
                for output in outputs:
                    self._deliver(output)
                if self.engine.step_count == step_before:
                    time.sleep(0.002)        # a dynamic batch is filling: nothing to compute yet
        except BaseException as error:       # surfaced to the owner; the thread ends
            self.error = error
            raise

    def _idle_wait(self) -> float:
        if self.load is None or self.commands.paused:
            return 0.5
        return min(0.5, max(0.0, self.load.next_arrival_s() - (time.monotonic() - self._started_at)))

    def _deliver(self, output: RequestOutput) -> None:
        listener = self._listeners.get(output.request_id)
        if listener is not None:
            try:
                listener(output)
            except Exception as error:      # an observer's bug must not stop the engine
                self.engine.refuse(f"deliver output of {output.request_id}", repr(error))
        if output.finished:
            self._listeners.pop(output.request_id, None)
            self.engine.release(output.request_id)     # a long-running loop keeps no finished requests

    def _admit_load(self) -> None:
        """The load's requests that are due. One due while a step ran arrived then, as one a server
        receives mid-step: its TTFT counts from its due time (one due while paused: from the resume)."""
        if self.load is None:
            return
        if self.commands.paused:
            self._load_paused = True
            return
        now = time.monotonic()
        if self._load_paused:
            self._load_paused, self._load_resumed_at = False, now
        for item in self.load.due(now - self._started_at):
            arrived = max(self._started_at + item.arrival_s, self._load_resumed_at)
            prompt = item_prompt(item, self._load_rng)
            exact = item.output_tokens is not None
            sampling = SamplingParams(max_tokens=item.output_tokens or 256, ignore_eos=exact)
            try:
                self.engine.add_request(prompt, sampling, arrival_time=arrived)
            except ValueError as error:
                self.engine.refuse("load request", str(error))
