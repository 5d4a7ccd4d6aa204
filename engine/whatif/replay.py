"""A recording re-scheduled by batchtop's scheduler: as recorded (identity), or under other knobs.

Identity follows the recording's own order: its arrivals, aborts, knob changes and pauses happen
where they happened between steps, and each step takes the recorded step's times, so the same
scheduler must plan the same step; `signatures` compares the two runs step by step. A what-if runs
on the virtual clock alone: requests arrive at their recorded times and, as in the engine's loop, are
taken in at the first step boundary after the engine could have them (their recorded input path later:
a server's parsing and tokenizing) with their TTFT counted from the arrival; aborts come the recorded
time after arrival, the recording's knob changes apply at their times (but for the knobs held
fixed); every step lasts what the step-time model predicts, and the gap before it what the gap law
gives for the arrivals taken in and the requests the step before retired.
"""
from __future__ import annotations

import functools
import gc
import heapq
from collections import defaultdict
from dataclasses import dataclass

from batchtop.telemetry import events as ev

from .recording import QUEUE_EXITS, Recording
from .steptime import GapSample, StepTimeModel, fit_model
from .virtual import PhaseTimes, StepShape, VirtualEngine

LOOP_POLL_S = 0.002         # the engine loop's wait while a dynamic batch forms
# A request is taken in at the first step boundary at or after its entry; the identity replay's
# boundary, a rounding error before the recorded take-in, still takes it in.
ARRIVAL_TOLERANCE_S = 1e-9
MAX_IDLE_POLLS = 1_000_000


def without_gc(function):
    """`function` with Python's cycle collector paused: a replay allocates events and requests by the ten
    thousand and frees none until it ends, so each collection it would set off finds nothing yet walks
    every live object (the recording's own events among them), slower the more runs are held. Reference
    counting still frees what it can; the collector resumes, as it was, when `function` returns."""
    @functools.wraps(function)
    def paused(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()
    return paused


@dataclass
class Identity:
    engine: VirtualEngine
    events: list[ev.Event]
    num_steps: int              # recorded steps
    num_matching: int           # replayed steps with the recorded step's scheduled requests
    first_mismatch: int | None  # the first step that differs

    @property
    def match_share(self) -> float:
        return self.num_matching / self.num_steps if self.num_steps else 1.0


def recorded_phases(finished: ev.StepFinished | None) -> PhaseTimes:
    if finished is None:
        return PhaseTimes(0.0, 0.0, 0.0, 0.0, 0.0)
    return PhaseTimes(finished.schedule_s, finished.prepare_s, finished.forward_s, finished.sample_s,
                      finished.update_s)


@without_gc
def replay_identity(rec: Recording, snapshot_interval_steps: int = 1000) -> Identity:
    """The recording replayed in its own order with its own step times."""
    events: list[ev.Event] = []
    engine = VirtualEngine(rec.setup, rec.setup.knobs, events.append, snapshot_interval_steps)
    finished = {e.step: e for e in rec.events if isinstance(e, ev.StepFinished)}
    items = {r.request_id: r for r in rec.requests}
    t0 = rec.t0
    engine.start_from(rec, 0.0)
    for e in rec.events:
        kind = type(e)
        if kind is ev.StepPlanned:
            done = finished.get(e.step)
            phases = recorded_phases(done)
            start = (done.t - t0 - phases.total_s) if done is not None else e.t - t0
            engine.step_count = e.step - 1
            engine.try_step(start, lambda shape, phases=phases: phases)
        elif kind is ev.RequestArrived:
            engine.add(items[e.request_id], e.t - t0)
        elif kind is ev.RequestRetired and e.reason in QUEUE_EXITS:
            engine.abort(e.request_id, e.t - t0, e.reason)
        elif kind is ev.KnobChanged:
            engine.set_knob(e.name, e.new, e.t - t0, e.source)
        elif kind in (ev.EnginePaused, ev.EngineResumed):
            engine.note_paused(kind is ev.EnginePaused, e.t - t0)
    return identity_of(rec, engine, events)


def identity_of(rec: Recording, engine, events: list[ev.Event]) -> Identity:
    """A replay's events against the recording's, step for step."""
    recorded = signatures(rec.events)
    compared = steps_in_order(recorded, signatures(events))[:len(recorded)]
    mismatch = next((step for step, alike in compared if not alike), None)
    return Identity(engine, events, len(recorded), sum(alike for _, alike in compared), mismatch)


def signatures(events, rename: dict[str, str] | None = None) -> dict[int, tuple]:
    """Per step, what the scheduler decided: the plan's counts, who was admitted, preempted, chunked,
    sampled and retired (request ids through `rename` where given). Two runs scheduled alike have
    equal signatures."""
    rename = rename or {}

    def name(request_id: str) -> str:
        return rename.get(request_id, request_id)

    parts: dict[int, list] = defaultdict(list)
    for e in events:
        kind = type(e)
        if kind is ev.StepPlanned:
            parts[e.step].append(("plan", e.prefill_tokens, e.recompute_tokens, e.decode_tokens,
                                  e.num_padding_rows, e.num_running, e.num_waiting, e.kv_blocks_used))
        elif kind is ev.RequestAdmitted:
            parts[e.step].append(("admit", name(e.request_id)))
        elif kind in (ev.RequestPreempted, ev.RequestRetracted):
            parts[e.step].append(("preempt", name(e.request_id)))
        elif kind is ev.PrefillChunk:
            parts[e.step].append(("chunk", name(e.request_id), e.num_tokens))
        elif kind is ev.StepFinished:
            parts[e.step].append(("sampled", *sorted(name(r) for r in e.sampled_request_ids)))
        elif kind is ev.RequestRetired and e.reason not in QUEUE_EXITS:
            parts[e.step].append(("retire", name(e.request_id), e.reason))
    return {step: tuple(sorted(p, key=repr)) for step, p in parts.items() if any(x[0] == "plan" for x in p)}


def steps_in_order(a: dict[int, tuple], b: dict[int, tuple]) -> list[tuple[int, bool]]:
    """Two runs' `signatures` side by side, the k-th step of one against the k-th of the other (a run
    recorded from the middle of a server's life numbers its steps from where the server had got to, its
    replay from 1): per k, A's number of the step (past A's last, counted on from it) and whether the
    two steps are alike."""
    steps_a, steps_b = sorted(a), sorted(b)
    last = steps_a[-1] if steps_a else 0
    return [(steps_a[k] if k < len(steps_a) else last + k - len(steps_a) + 1,
             k < len(steps_a) and k < len(steps_b) and a[steps_a[k]] == b[steps_b[k]])
            for k in range(max(len(steps_a), len(steps_b)))]


def fit_steps(rec: Recording, identity: Identity) -> StepTimeModel:
    """The step-time model from the recording's timed steps, each paired with the shape the identity
    replay computed for it (exact where the replay matched)."""
    finished = {e.step: e for e in rec.events if isinstance(e, ev.StepFinished)}
    shapes, done = [], []
    for step, shape in zip(_replayed_steps(identity.events), identity.engine.shapes):
        if step in finished:
            shapes.append(shape)
            done.append(finished[step])
    return fit_model(shapes, done, recorded_gaps(rec), rec.setup.weight_macs, rec.setup.product_tile_rows)


def recorded_gaps(rec: Recording) -> list[GapSample]:
    """The gaps between back-to-back recorded steps (work left after the first), each with the arrivals
    taken in before the second (their events carry the first's step number) and the first's
    retirements."""
    arrived: dict[int, int] = defaultdict(int)
    retired: dict[int, int] = defaultdict(int)
    for e in rec.events:
        if isinstance(e, ev.RequestArrived):
            arrived[e.step] += 1
        elif isinstance(e, ev.RequestRetired) and e.reason not in QUEUE_EXITS:
            retired[e.step] += 1
    ordered = sorted(rec.steps, key=lambda e: e.step)
    gaps = []
    for before, after in zip(ordered, ordered[1:]):
        if before.num_running + before.num_waiting > 0 and after.step == before.step + 1:
            start = after.t - recorded_phases(after).total_s
            gaps.append(GapSample(start - before.t, arrived[before.step], retired[before.step]))
    return gaps


def _replayed_steps(events) -> list[int]:
    return [e.step for e in events if isinstance(e, ev.StepPlanned)]


@without_gc
def run_whatif(rec: Recording, knobs: dict, model, held: frozenset[str] = frozenset(),
               snapshot_interval_steps: int = 1000, gap=None) -> tuple[VirtualEngine, list[ev.Event]]:
    """The recording's trace under `knobs` on the virtual clock; `model(shape)` gives each step's
    phases, `gap(num_arrived, num_retired)` the loop's time before it (None: none). The recording's
    own changes of the knobs in `held` are left out."""
    events: list[ev.Event] = []
    engine = VirtualEngine(rec.setup, knobs, events.append, snapshot_interval_steps)
    arrivals = sorted(rec.requests, key=lambda r: r.entry_s)
    aborts: list[tuple[float, str, str]] = []
    changes = [(t, name, new) for t, name, new in rec.knob_changes if name not in held]
    a = c = idle_polls = 0
    num_arrived = num_retired = 0          # since the last step
    now = 0.0
    engine.start_from(rec, now)
    for r in (item.request for item in rec.in_flight if item.request.abort_after_s is not None):
        heapq.heappush(aborts, (r.arrival_s + r.abort_after_s, r.request_id, r.reason))
    while True:
        while a < len(arrivals) and arrivals[a].entry_s <= now + ARRIVAL_TOLERANCE_S:
            item = arrivals[a]
            engine.add(item, now)
            num_arrived += 1
            if item.abort_after_s is not None:
                heapq.heappush(aborts, (item.arrival_s + item.abort_after_s, item.request_id, item.reason))
            a += 1
        while aborts and aborts[0][0] <= now:
            t, request_id, reason = heapq.heappop(aborts)
            engine.abort(request_id, t, reason)
        while c < len(changes) and changes[c][0] <= now:
            engine.set_knob(changes[c][1], changes[c][2], changes[c][0], "recorded")
            c += 1
        start = now + (gap(num_arrived, num_retired) if gap is not None and engine.has_work() else 0.0)
        phases = engine.try_step(start, model)
        if phases is not None:
            now = start + phases.total_s
            num_arrived, num_retired = 0, engine.num_retired_last
            idle_polls = 0
            continue
        upcoming = [arrivals[a].entry_s] if a < len(arrivals) else []
        upcoming += [aborts[0][0]] if aborts else []
        upcoming += [changes[c][0]] if c < len(changes) else []
        if engine.has_work():
            upcoming += _dynamic_deadline(engine, now) or [now + LOOP_POLL_S]
            idle_polls += 1
            if idle_polls > MAX_IDLE_POLLS:
                raise ValueError(f"the what-if under {knobs} makes no progress at t={now:.1f} s "
                                 f"({len(engine.scheduler.waiting)} waiting, none admitted)")
        else:
            idle_polls = 0
        if not upcoming:
            return engine, events
        now = max(now, min(upcoming))


def _dynamic_deadline(engine: VirtualEngine, now: float) -> list[float]:
    """When a forming dynamic batch times out (a hair past, so the scheduler's own test agrees)."""
    scheduler = engine.scheduler
    if scheduler.knobs.batching_mode != "dynamic" or not scheduler.waiting or scheduler.running:
        return []
    deadline = scheduler.waiting[0].arrival_time + scheduler.knobs.dynamic_timeout_s + 1e-9
    return [deadline] if deadline > now else []


def constant_steps(seconds: float):
    """A step-time model of constant steps (tests, and recordings without a fit)."""
    def phases(shape: StepShape) -> PhaseTimes:
        return PhaseTimes(0.0, 0.0, seconds, 0.0, 0.0)
    return phases
