"""Hand-built event sequences shared by the telemetry tests."""
from __future__ import annotations

from batchtop.telemetry.events import (
    BatchRebuilt, CommandRefused, EnginePaused, EngineResumed, EventsDropped, FirstToken,
    KnobChanged, PrefillChunk, RequestAdmitted, RequestArrived, RequestPreempted,
    RequestRetired, RequestRetracted, RowMoved, StepFailed, StepFinished, StepPlanned,
)


def one_of_each() -> list:
    """One event of every kind, with awkward values (floats, empty tuple, unicode, None)."""
    return [
        RequestArrived(0, 0.1, "req-ü-0", 17, 64, 2),
        StepPlanned(1, 0.25, 17, 0, 1, 0, 0, 2048, 1, 0, 2, 100),
        RequestAdmitted(1, 0.2500001, "req-ü-0", 0, 0, False),
        PrefillChunk(1, 0.26, "req-ü-0", 17, 17, 17),
        StepFinished(1, 0.3, 1, 17, ("req-ü-0",), 1, 0, 2, 100,
                     1e-4, 2e-4, 0.0123456789, 3e-5, 1.5e-5),
        StepFinished(2, 0.31, 0, 0, (), 0, 0, 0, 100, 0.0, 0.0, 0.0, 0.0, 0.0),
        FirstToken(1, 0.3, "req-ü-0", 0.2),
        RowMoved(2, 0.4, "req-ü-0", 3, 0, 4096),
        BatchRebuilt(2, 0.4, "condense", 3, 1, 1, 1, 4096),
        RequestPreempted(3, 0.5, "req-ü-0", 0, 2, 20, "kv pool dry"),
        RequestRetracted(4, 0.6, "req-ü-0", 0, 2, 21, 0.3333333333333333),
        KnobChanged(5, 0.7, "max_num_seqs", 8, 16, "tui"),
        KnobChanged(5, 0.7, "batching_mode", "continuous", "static", "cli"),
        KnobChanged(5, 0.7, "timeout", None, 0.25, "api"),
        KnobChanged(5, 0.7, "ignore_eos", False, True, "test"),
        CommandRefused(6, 0.8, "set_knob", "max_num_seqs must be in 1..256"),
        EnginePaused(7, 0.9),
        EngineResumed(7, 1.0),
        RequestRetired(8, 1.1, "req-ü-0", "stop", 0, 17, 5),
        RequestRetired(8, 1.1, "req-1", "abort", -1, 3, 0),
        EventsDropped(9, 1.2, 15),
        StepFailed(10, 1.3, "RuntimeError: simulated kernel failure"),
    ]


STATIC_LENGTHS = [1024, 200, 180, 150, 140, 120, 84, 70]


def static_batch(lengths=STATIC_LENGTHS, dt=0.01) -> list:
    """The reference text's static batch: all rows admitted together, the batch runs until
    the longest row finishes, and every step computes all rows (finished ones as padding).
    Step k (1-based) finishes at k*dt and samples the rows with k <= n_i.
    """
    events = []
    num_rows = len(lengths)
    ids = [f"r{i}" for i in range(num_rows)]
    for rid in ids:
        events.append(RequestArrived(0, 0.0, rid, 10, 2000, 0))
    for slot, rid in enumerate(ids):
        events.append(RequestAdmitted(1, 0.0, rid, slot, 0, False))
    for k in range(1, max(lengths) + 1):
        t = k * dt
        sampled = tuple(rid for rid, n in zip(ids, lengths) if k <= n)
        events.append(StepFinished(k, t, num_rows, num_rows, sampled, len(sampled), 0,
                                   num_rows, 64, 0.0, 0.0, dt, 0.0, 0.0))
        if k == 1:
            events += [FirstToken(k, t, rid, t) for rid in ids]
        for slot, (rid, n) in enumerate(zip(ids, lengths)):
            if n == k:
                events.append(RequestRetired(k, t, rid, "length", slot, 10, n))
    return events
